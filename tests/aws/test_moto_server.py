"""The tests' moto server keeps SQS's FIFO message group rule when receives overlap
(tests/aws/serve_moto.py): the Exclusive order tests rely on it, and plain moto breaks it."""

from __future__ import annotations

import threading
from typing import Any

from ..conftest import unique
from .deployed import sqs_client

ROUNDS = 5


def test_overlapping_receives_never_share_a_message_group(moto_url: str) -> None:
    """Two receives sent at once on a FIFO queue with four groups: while one holds messages of a group,
    the other gets none of that group (plain moto splits a group between them in most rounds)."""
    sqs = sqs_client(moto_url)
    clients = [sqs_client(moto_url) for _ in range(2)]
    for _ in range(ROUNDS):
        url = sqs.create_queue(QueueName=f"{unique('groups')}.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
        for key in range(4):
            for n in range(6):
                sqs.send_message(QueueUrl=url, MessageBody=f"k{key}:{n}", MessageGroupId=f"k{key}",
                                 MessageDeduplicationId=f"k{key}:{n}")
        answers: list[list[dict[str, Any]]] = [[], []]
        start = threading.Barrier(2)

        def receive(i: int, url: str = url, start: threading.Barrier = start,
                    answers: list[list[dict[str, Any]]] = answers) -> None:
            start.wait()
            answers[i] = clients[i].receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0,
                                                    VisibilityTimeout=60).get("Messages", [])

        threads = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        bodies = [[m["Body"] for m in answer] for answer in answers]
        groups = [{body.split(":")[0] for body in received} for received in bodies]
        assert not groups[0] & groups[1], bodies
        for received in bodies:  # each group's messages in order, from its first
            for group in {body.split(":")[0] for body in received}:
                assert [b for b in received if b.startswith(f"{group}:")] == [
                    f"{group}:{n}" for n in range(sum(b.startswith(f"{group}:") for b in received))]


def test_a_group_whose_messages_all_timed_out_starts_again_from_its_first(moto_url: str) -> None:
    """Three messages of one group received together and all let go (their visibility runs out
    together, as after a worker's SIGKILL): the next receive hands out the group's first message,
    as SQS does (plain moto handed out its last)."""
    import time

    sqs = sqs_client(moto_url)
    url = sqs.create_queue(QueueName=f"{unique('timeout')}.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    for n in range(3):
        sqs.send_message(QueueUrl=url, MessageBody=f"m{n}", MessageGroupId="g", MessageDeduplicationId=f"m{n}")
    held = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=60)["Messages"]
    assert [m["Body"] for m in held] == ["m0", "m1", "m2"]
    for message in held:  # (m0 first)
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=1)
    time.sleep(1.5)
    again = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=1, WaitTimeSeconds=5)["Messages"]
    assert [m["Body"] for m in again] == ["m0"]
