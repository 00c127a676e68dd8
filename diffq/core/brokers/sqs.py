"""SQS: everything diffq does on an SQS broker beyond kombu's public API (`SQSBroker`).

SQS hides a received message for its visibility timeout; the holder extends it with
`ChangeMessageVisibility` on the receipt handle (kombu/transport/SQS). Queues are
listed by name prefix (kombu maps '.' to '-' and prepends its `queue_name_prefix`,
kombu/transport/SQS/__init__.py `entity_name`).

Dead letters: a redrive policy on each shape queue moves a message received
`maxReceiveCount` times to `diffq-dead`; a message diffq refuses goes there at once
as a letter and is deleted (kombu's reject leaves a message of a queue with a redrive
policy for SQS to redeliver, kombu/transport/SQS `basic_reject`: a message that can
never succeed would go to workers that many times more).
"""

from __future__ import annotations

import base64
import json
import string
from collections.abc import Callable

from diffq.core.brokers.base import (DEAD_LETTERS, PEEKED_LETTERS, PREFIX, Broker, DeadLetterReport,
                                     envelope_payload, envelope_queue, letter_fields)
from diffq.core.contract import queue_from_entity_name

# Receives before SQS moves a batch to the dead letters: each lapsed lease, hand-back
# and requeue is one, so a batch whose host was lost a few times still runs.
SQS_MAX_RECEIVES = 20


class SQSBroker(Broker):
    """SQS: leases by the message's visibility, queues listed by name prefix, a redrive
    policy to `diffq-dead` and its sample peeked with visibility 0."""

    def renew(self, channel, messages: list) -> int:
        """ChangeMessageVisibility on each held receipt handle: hidden for another timeout."""
        return _change_visibility(channel, messages, int(channel.visibility_timeout))

    def hand_back(self, channel, messages: list) -> int:
        """Visibility 0: the held messages are receivable again at once."""
        return _change_visibility(channel, messages, 0)

    def list_queues(self, connection, prefix: str = PREFIX, api: str | None = None) -> list[str]:
        """ListQueues by name prefix, mapped back to diffq's names (the caller keeps the
        ones that parse as shape queues: '-' for '.' is only undone where it was a dot)."""
        channel = connection.default_channel
        own = channel.queue_name_prefix
        wanted = channel.entity_name(own + prefix)
        names = []
        for page in channel.sqs().get_paginator("list_queues").paginate(QueueNamePrefix=wanted):
            for url in page.get("QueueUrls", []):
                names.append(url.rsplit("/", 1)[-1][len(own):])
        return sorted(_undo_sqs_names(names, prefix))

    def declare_dead_letters(self, connection, queues: list[str], api: str | None = None) -> bool:
        """`diffq-dead`, and a redrive policy to it on each of `queues` that has none or
        diffq's with another count (a policy to another queue is the operator's: left as
        it is). False: diffq itself moves what it refuses."""
        channel = connection.default_channel
        dead_url = channel._new_queue(DEAD_LETTERS)
        client = channel.sqs(queue=channel.canonical_queue_name(DEAD_LETTERS))
        arn = client.get_queue_attributes(QueueUrl=dead_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        for queue in queues:
            if queue == DEAD_LETTERS:
                continue
            url = channel._new_queue(queue)
            found = client.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])
            current = json.loads(found.get("Attributes", {}).get("RedrivePolicy") or "{}")
            if current.get("deadLetterTargetArn", arn) != arn or \
                    str(current.get("maxReceiveCount")) == str(SQS_MAX_RECEIVES):
                continue
            client.set_queue_attributes(QueueUrl=url, Attributes={"RedrivePolicy": json.dumps(
                {"deadLetterTargetArn": arn, "maxReceiveCount": str(SQS_MAX_RECEIVES)})})
        return False

    def peek_dead_letters(self, connection, limit: int = PEEKED_LETTERS, peeked: Callable | None = None) -> DeadLetterReport:
        """ApproximateNumberOfMessages, and up to 10 received with visibility 0 (visible
        again at once: nothing to end; SQS picks which). A batch the redrive policy moved
        is a kombu envelope."""
        channel = connection.default_channel
        url = channel._new_queue(DEAD_LETTERS)
        client = channel.sqs(queue=channel.canonical_queue_name(DEAD_LETTERS))
        attributes = client.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
        count = int(attributes["Attributes"]["ApproximateNumberOfMessages"])
        messages = []
        if limit > 0 and count:
            messages = client.receive_message(QueueUrl=url, MaxNumberOfMessages=min(limit, 10), VisibilityTimeout=0,
                                              WaitTimeSeconds=0, AttributeNames=["All"]).get("Messages", [])
        letters = []
        for message in messages:
            body = message.get("Body", "")
            try:
                envelope = json.loads(body)
            except ValueError:
                try:
                    envelope = json.loads(base64.b64decode(body))
                except (ValueError, TypeError):
                    envelope = None
            received = message.get("Attributes", {}).get("ApproximateReceiveCount", "?")
            if not isinstance(envelope, dict):
                letters.append({"queue": None, "reason": "not a kombu message", "at": None})
                continue
            letters.append(letter_fields(envelope_payload(envelope), envelope_queue(envelope),
                                         f"moved by the redrive policy (received {received} times)"))
        return DeadLetterReport(count, letters, "a sample (SQS keeps no order)")


def _change_visibility(channel, messages: list, seconds: int) -> int:
    renewed = 0
    for message in messages:
        info = message.delivery_info
        sqs_message, queue_url = info.get("sqs_message"), info.get("sqs_queue")
        if not sqs_message or not queue_url:
            continue
        queue = channel.canonical_queue_name(info["routing_key"]) if info.get("routing_key") else None
        channel.sqs(queue=queue).change_message_visibility(
            QueueUrl=queue_url, ReceiptHandle=sqs_message["ReceiptHandle"],
            VisibilityTimeout=seconds)
        renewed += 1
    return renewed



def _undo_sqs_names(names: list[str], prefix: str) -> list[str]:
    dashed = prefix.replace(".", "-")
    return [queue_from_entity_name(name) or (prefix + name[len(dashed):] if name.startswith(dashed) else name)
            for name in names]



def sqs_entity_name(queue: str) -> str:
    """The SQS queue kombu creates for `queue` ('.' -> '-', other punctuation but
    '-' and '_' -> '_'; kombu/transport/SQS/__init__.py `entity_name`)."""
    table = {ord(c): "_" for c in string.punctuation if c not in "-_."}
    table[ord(".")] = "-"
    return queue.translate(table)
