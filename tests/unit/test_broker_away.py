"""Which Kafka errors a service waits out (a broker restarting) and which it raises at once."""
from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from infra.kafka import while_broker_away


def failing_then(errors: list[int], value: str):
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise KafkaException(KafkaError(errors[len(calls) - 1]))
        return value
    return fn, calls


def test_a_partition_the_client_has_not_relearned_after_a_broker_restart_is_waited_out() -> None:
    # A shard writer died in the fault test: list_topics answered while the broker came back, and the
    # watermark query that followed raised _UNKNOWN_PARTITION before the partition's leader was known.
    fn, calls = failing_then([KafkaError._UNKNOWN_PARTITION, KafkaError._TRANSPORT], "marks")
    assert while_broker_away("watermarks", fn, timeout_s=10) == "marks"
    assert len(calls) == 3


def test_an_error_a_restart_does_not_explain_raises_at_once() -> None:
    fn, calls = failing_then([KafkaError.TOPIC_AUTHORIZATION_FAILED], "never")
    with pytest.raises(KafkaException):
        while_broker_away("watermarks", fn, timeout_s=10)
    assert len(calls) == 1


def test_waiting_is_bounded() -> None:
    fn, calls = failing_then([KafkaError._TRANSPORT] * 100, "never")
    with pytest.raises(KafkaException):
        while_broker_away("watermarks", fn, timeout_s=1.2)
    assert 1 < len(calls) < 5
