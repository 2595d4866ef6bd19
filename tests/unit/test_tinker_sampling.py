"""A Tinker sample request off the bus (TINKER_SAMPLES): what a replica refuses before it samples."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("change", "field"), [
    (lambda r: r.ClearField("request_id"), "request_id"),
    (lambda r: r.ClearField("session"), "session"),
    (lambda r: r.ClearField("prompt"), "prompt"),
    (lambda r: r.prompt.append(2**31), "prompt"),
    (lambda r: setattr(r, "num_samples", 0), "num_samples"),
    (lambda r: setattr(r, "num_samples", 257), "num_samples"),
    (lambda r: setattr(r, "max_tokens", 0), "max_tokens"),
    (lambda r: setattr(r.session, "version", 0), "session"),
    (lambda r: setattr(r, "temperature", float("nan")), "temperature"),
    (lambda r: r.stop.token_ids.append(-1), "stop.token_ids"),
])
def test_a_sample_request_off_the_bus_is_refused_naming_its_field(change, field: str) -> None:  # type: ignore[no-untyped-def]
    """What a replica checks of a TINKER_SAMPLES message (its PullWorker dead-letters the refusal)."""
    from policyloop.contracts.v1 import tinker_pb2
    from policyloop.tinker.sampling import validate_sample_request

    def good() -> tinker_pb2.TinkerSampleRequest:
        return tinker_pb2.TinkerSampleRequest(
            request_id="s#1#a", prompt=[4, 5], num_samples=2, max_tokens=3, temperature=1.0, top_p=1.0, top_k=-1,
            session=tinker_pb2.TinkerSamplingSession(weights_model="policy.lora.m", version=1,
                                                     fetch_endpoint="127.0.0.1:1"))

    validate_sample_request(good())
    request = good()
    change(request)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate_sample_request(request)
