"""The user-facing commands (`kvstore serve/status/objects/smoke/demo`): the composition root,
which may import anything (the daemon, the client, the reference engine). The daemon's
own packages import neither `client` nor `gpu`."""
