"""Send a bundle to an OpenAI-compatible server (vLLM) with its layering decision.

The system message is `bundle.as_prompt_messages(...)`'s byte-stable prefix, so every
turn over the same bundle reuses the engine's prefix cache; the layering policy's
`kv_transfer_params` ride in `extra_body`, which vLLM forwards to LMCache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epistemic_kvcache.context.layering import (
    KVCacheLayeringPolicy,
    LayeringDecision,
    LayeringRequest,
    PriorityClass,
)
from epistemic_kvcache.context.model import DEFAULT_SYSTEM_PREAMBLE, ContextBundle
from epistemic_kvcache.context.tokens import ApproxTokenCounter, TokenCounter

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types.chat import ChatCompletion

DEFAULT_TIMEOUT_S = 60.0
"""Long prefills of cold bundles take seconds; a minute bounds a stuck server."""
DEFAULT_MAX_RETRIES = 2


def make_openai_client(
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_retries: int = DEFAULT_MAX_RETRIES,
) -> OpenAI:
    """An `openai.OpenAI` client with a bounded timeout and retry count.

    `base_url` defaults to `OPENAI_BASE_URL`; `api_key` to `OPENAI_API_KEY`, else
    `"EMPTY"` (vLLM accepts any key unless started with `--api-key`).
    """
    from openai import OpenAI

    return OpenAI(
        base_url=base_url or os.environ.get("OPENAI_BASE_URL"),
        api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
        timeout=timeout_s,
        max_retries=max_retries,
    )


def layering_request_for(
    bundle: ContextBundle,
    messages: list[dict[str, str]],
    *,
    priority: PriorityClass = PriorityClass.STANDARD,
    token_counter: TokenCounter | None = None,
    expected_reuse: int | None = None,
) -> LayeringRequest:
    """The `LayeringRequest` describing a bundle call: its prompt length, the bundle key
    as shared prefix, and the system prompt."""
    counter = token_counter or ApproxTokenCounter()
    return LayeringRequest(
        prompt_tokens=sum(counter.count(m["content"]) for m in messages),
        priority=priority,
        shared_prefix_key=bundle.cache_key,
        system_prompt=messages[0]["content"],
        expected_reuse=expected_reuse,
    )


@dataclass(frozen=True, slots=True)
class BundleCompletion:
    """A bundle call's result: the completion, the layering decision (`None` without a
    policy), the messages sent and the wall-clock latency."""

    completion: ChatCompletion
    decision: LayeringDecision | None
    messages: list[dict[str, str]]
    extra_body: dict[str, Any]
    latency_s: float


def bundle_chat_completion(
    bundle: ContextBundle,
    turn_text: str,
    *,
    client: OpenAI | None = None,
    model: str = "default",
    policy: KVCacheLayeringPolicy | None = None,
    priority: PriorityClass = PriorityClass.STANDARD,
    system_preamble: str = DEFAULT_SYSTEM_PREAMBLE,
    extra_body: Mapping[str, Any] | None = None,
    max_tokens: int | None = 256,
    temperature: float | None = None,
) -> BundleCompletion:
    """Ask `model` about `turn_text` over `bundle`.

    `client=None` builds one with `make_openai_client()` (bounded timeout and retries).
    The decision's `kv_transfer_params` are merged into `extra_body` (other
    `kv_transfer_params` keys the caller set are kept).
    """
    messages = bundle.as_prompt_messages(turn_text, system_preamble=system_preamble)
    body: dict[str, Any] = dict(extra_body or {})
    decision = None
    if policy is not None:
        decision = policy.decide(layering_request_for(bundle, messages, priority=priority))
        params = dict(body.get("kv_transfer_params") or {})
        params.update(decision.kv_transfer_params)
        body["kv_transfer_params"] = params
    cli = client if client is not None else make_openai_client()
    from openai import omit

    started = time.perf_counter()
    completion = cli.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        extra_body=body or None,
        max_tokens=omit if max_tokens is None else max_tokens,
        temperature=omit if temperature is None else temperature,
    )
    return BundleCompletion(completion, decision, messages, body, time.perf_counter() - started)
