from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA

LOG = []

class M(KVConnectorMetadata):
    pass

class ProbeConnector(KVConnectorBase_V1, SupportsHMA):
    HIT = 0
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        LOG.append(("lookup", request.request_id, num_computed_tokens))
        return max(0, ProbeConnector.HIT - num_computed_tokens), False
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        LOG.append(("alloc", request.request_id, blocks.get_block_ids(), num_external_tokens))
    def build_connector_meta(self, so):
        bs = so.kv_connector_block_state
        LOG.append(("meta", dict(so.num_scheduled_tokens),
                    [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs],
                    list(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.new_block_ids)),
                    bs.boundary_state_offloads if bs else None,
                    {r: bs.get_block_ids(r) for r in bs.req_ids} if bs else None))
        return M()
    def request_finished_all_groups(self, request, block_ids):
        LOG.append(("finished", request.request_id, block_ids))
        return False, None
    def start_load_kv(self, fc, **kw): pass
    def wait_for_layer_load(self, n): pass
    def save_kv_layer(self, *a, **k): pass
    def wait_for_save(self): pass
