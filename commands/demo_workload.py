"""The agent-like workload `kvstore demo` runs: texts and the order of turns.

Every session starts with the same system prompt and tool descriptions (the long shared
prefix), then alternates user turns and model answers. One branch retries a turn from an
earlier point of a session; one session is resumed after the daemon restarts.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM = (
    "You are Atlas, the operations agent of a small online shop. You help the support, billing "
    "and infrastructure teams. Work step by step: read the request, decide which tool gives the "
    "facts you need, call it, check the result, and only then answer. Never invent order "
    "numbers, amounts or host names; if a tool result is missing, say so and ask for it. Keep "
    "answers short and concrete, name the tool calls you make, and end with the next action. "
    "Refunds above 500 dollars and any change to production need a human approval, which you "
    "request with the approvals tool. Customer data is private: quote only what the task needs."
)

POLICIES = (
    "Policies. 1. Identity: before touching an order, confirm the customer id on the order matches "
    "the ticket. 2. Money: refunds go back to the original capture only; never to a new card, "
    "never as store credit unless the customer asks. Partial refunds need the line items. "
    "3. Duplicates: a second capture within ten minutes for the same amount and card is a "
    "duplicate unless it is a pre-authorization that will expire; pre-authorizations are never "
    "refunded, they are voided. 4. Incidents: an alert is an incident when a service-level "
    "objective is at risk. Record the start time, the first symptom, the suspected change and "
    "each action with its time. Prefer a rollback to a hotfix when a deploy is suspected. "
    "5. Communication: customers get one reply that states what happened, what we did, and when "
    "they will see the money; no internal names, no blame. Engineers get a timeline. "
    "6. Data: aggregate queries over orders are allowed; exports of personal data are not. "
    "7. Escalation: after two failed attempts at the same step, stop and ask a human."
)

TOOLS = [
    ("orders.lookup", "Fetch an order by its number: items, amounts, payment captures, refunds, "
     "shipping status and the customer id.", "order_id: string"),
    ("payments.captures", "List the payment captures and pre-authorizations of an order with "
     "their timestamps, amounts, card network and processor reference.", "order_id: string"),
    ("payments.refund", "Refund an amount of one capture. Idempotent per capture and amount; "
     "returns the refund id and the expected settlement date.", "capture_id: string, amount: number, reason: string"),
    ("customers.profile", "Read a customer's profile: name, email, country, lifetime value, "
     "open tickets and the notes of earlier contacts.", "customer_id: string"),
    ("tickets.reply", "Send a reply on a support ticket, as plain text, signed by the team. "
     "Replies are logged and cannot be edited afterwards.", "ticket_id: string, body: string"),
    ("metrics.query", "Run a PromQL query over the last hours of metrics of the shop's services "
     "and return the series as a table of timestamps and values.", "query: string, hours: integer"),
    ("logs.search", "Search the service logs for a pattern within a time window; returns at most "
     "fifty matching lines with host, service and timestamp.", "pattern: string, since: string"),
    ("deploys.history", "List recent deploys of a service: version, author, time, and whether the "
     "deploy was rolled back.", "service: string, limit: integer"),
    ("approvals.request", "Ask a human to approve an action. Returns an approval id; the action "
     "may run once the approval is granted.", "action: string, justification: string"),
    ("kb.search", "Search the internal knowledge base of runbooks and policies; returns titles, "
     "links and the matching paragraphs.", "query: string"),
]


def system_text(num_tools: int) -> str:
    tools = "\n".join(f"- {name}({params}): {desc}" for name, desc, params in TOOLS[:num_tools])
    return f"{SYSTEM}\n\n{POLICIES}\n\nTools (call one per line as name(arguments)):\n{tools}"


SESSIONS = {
    "billing": [
        "Ticket 7730 from customer 4411: 'I was charged twice for order 98213, please fix it.' "
        "What do you check first?",
        "Tool result payments.captures(order_id=98213):\n"
        "cap_8812  2026-11-30 10:02:11  49.00 USD  visa *4242  captured  ref pi_3Nf8\n"
        "cap_8813  2026-11-30 10:02:52  49.00 USD  visa *4242  captured  ref pi_3Nf9\n"
        "Tool result orders.lookup(order_id=98213): customer 4411, 1 item (desk lamp, 49.00), "
        "shipped 2026-11-30, no refunds. What is the next step?",
        "Tool result payments.refund(capture_id=cap_8813, amount=49.00): refund rf_5521, "
        "settles in 3 to 5 business days. Draft the reply for ticket 7730.",
    ],
    "infra": [
        "Alert: checkout p99 latency 1.9 s (objective 0.8 s) since 14:02, error rate normal. "
        "Where do you start?",
        "Tool result deploys.history(service=checkout, limit=3):\n"
        "2.14.1  13:55  j.ortiz  not rolled back\n2.14.0  yesterday 16:10  m.chen  not rolled back\n"
        "2.13.9  3 days ago  m.chen  rolled back\n"
        "Tool result logs.search(pattern=timeout, since=13:50): 212 lines, all 'inventory client "
        "timeout after 1500 ms' from checkout pods. What now?",
        "The rollback to 2.14.0 finished at 14:31 and p99 is 0.6 s again. Write the incident "
        "timeline for the engineers.",
    ],
    "research": [
        "How many orders of the last seven days were refunded for duplicate captures? Plan the "
        "queries before you run them.",
        "Tool result metrics.query(query=sum(increase(refunds_total{reason='duplicate'}[7d])), "
        "hours=168): 37. Tool result metrics.query(query=sum(increase(orders_total[7d])), "
        "hours=168): 18412. Which card networks do the duplicates come from?",
        "Tool result: visa 29, mastercard 6, amex 2; 33 of 37 happened within 60 seconds of a "
        "checkout retry after a timeout. Propose one change that would stop them.",
    ],
}
BRANCH_TEXT = ("Wait: before refunding, check whether cap_8813 is only a pre-authorization; "
               "the processor reference pi_3Nf9 belongs to a retried payment intent.")
RESUME_TEXT = ("Alert again at 15:40: checkout p99 1.4 s, inventory service CPU at 95 percent. "
               "The rollback is still in place. What do you check next?")


@dataclass(frozen=True, slots=True)
class Turn:
    session: str
    text: str
    label: str
    parent: int | None = None  # branch: continue the session as it was after this many turns
    after_restart: bool = False


@dataclass(frozen=True, slots=True)
class Profile:
    num_tools: int
    num_sessions: int
    num_turns: int
    max_new_tokens: int


PROFILES = {
    "default": Profile(num_tools=10, num_sessions=3, num_turns=3, max_new_tokens=16),
    "quick": Profile(num_tools=3, num_sessions=2, num_turns=2, max_new_tokens=4),
}


def plan(profile: Profile) -> list[Turn]:
    """Rounds of turns across sessions, the branch after round 2, the resume at the end."""
    names = list(SESSIONS)[:profile.num_sessions]
    turns = []
    for i in range(profile.num_turns):
        turns += [Turn(s, SESSIONS[s][i], f"{s} #{i + 1}") for s in names]
        if i == 1:
            turns.append(Turn(names[0], BRANCH_TEXT, f"{names[0]} #2 retry", parent=1))
    resumed = names[1] if len(names) > 1 else names[0]
    turns.append(Turn(resumed, RESUME_TEXT, f"{resumed} resumed", after_restart=True))
    return turns
