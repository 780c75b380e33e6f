"""An agent's logic run as a Faust agent: batches taken, handed over as plain messages, acked after delivery.

``faust_agent`` is the one adapter between Faust and the agents' logic (``streams.ports.Agent``):

1. ``Batches`` (``acks.py``) takes the agent's batches by its ``BatchRule``, acking nothing;
2. the batch's messages (each event's ``message``) go to ``agent.handle`` with a fresh ``Outbox``
   (``outbox.py``) for everything it produces;
3. the outbox is delivered (every record acknowledged by the broker), and only then the batch is acked.

Upstream behaviour worked around: Faust's ``take_events`` acks every event of a batch in a
``finally``, and ``events()`` each event, even when the agent body raised; Faust's supervisor then
restarts the agent on the next batch and the failed batch's offsets get committed (faust-streaming
0.15.3, ``faust/streams/stream.py``). So an exception escaping the agent (an outage past the retry
budget, or a bug) ends the process at once, unacked (``streams.faults.exit_without_ack``), instead of
reaching Faust. CancelledError is no Exception: Faust cancels agents to stop them and on a
rebalance, and an unacked batch then is read again where the partition is assigned next.
Tests: tests/streams/test_agent_logic.py ``test_the_adapter_acks_a_batch_only_after_its_records_are_delivered``
and ``test_an_agent_that_fails_ends_the_process_unacked``; end to end
tests/streams/test_no_ack_on_failure.py.
"""

from __future__ import annotations

from typing import Any, Callable

from streams.faults import exit_without_ack
from streams.faust_runtime.acks import Batches
from streams.ports import Agent, Outbox


def faust_agent(name: str, agent: Agent, outbox: Callable[[], Outbox],
                exit: Callable[[str, BaseException], Any] = exit_without_ack):
    """The ``async def fn(stream)`` Faust wants, running ``agent`` (``app.agent(...)(faust_agent(...))``)."""
    async def run(stream: Any) -> None:
        try:
            await serve(stream, agent, outbox)
        except Exception as exc:  # noqa: BLE001 - every failure gets the same answer: exit unacked
            exit(f"streams.{name}", exc)

    run.__name__ = run.__qualname__ = name
    return run


async def serve(stream: Any, agent: Agent, outbox: Callable[[], Outbox]) -> None:
    """Each batch of ``stream`` to ``agent.handle``, acked once what it sent is on the broker."""
    rule = agent.batching
    batches = Batches(stream, rule.max_events, rule.within_s, idle_s=rule.idle_s)
    async for events in batches:
        box = outbox()
        await agent.handle([event.message for event in events], box)
        await box.deliver()
        await batches.ack(events)
