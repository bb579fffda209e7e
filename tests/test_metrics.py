"""The metrics actor: every series the reference names, at zero before traffic, moved by
the messages that carry them, read back from the exposition with prometheus_client's
parser (so the names checked are the names a scraper sees: a Counter "imp_x" is
exposed as imp_x_total)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from imp.actors.base import Bus
from imp.actors.metrics import ENDPOINTS, MetricsActor, Rates
from imp.log.eventlog import EventLog
from imp.messages import Fault, Figures, KvFigures, QueueFigures, RequestStats, StepStats

COUNTERS = [
    # "Metrics for what the server decided"
    "imp_requests_timed_out_total", "imp_kv_pressure_rejections_total", "imp_kv_pool_growths_total",
    "imp_streaming_kv_auto_enables_total", "imp_prefix_cache_evictions_total", "imp_requests_cancelled_total",
    "imp_prefix_cache_inflight_waits_total",
    "imp_kv_swaps_total",
    # request tracing
    "imp_otlp_spans_exported_total", "imp_otlp_export_failures_total", "imp_otlp_unsampled_requests_total",
    # batch shape, tokens, requests, faults
    "imp_decode_batch_rows_total", "imp_decode_batch_steps_total", "imp_preemptions_total", "imp_requests_total",
    "imp_tokens_generated_total", "imp_tokens_prompt_total", "imp_tokens_cached_total", "imp_actor_faults_total",
]
GAUGES = [
    "imp_queue_waiting", "imp_queue_running", "imp_queue_depth", "imp_queued_prompt_tokens",
    "imp_kv_blocks_total", "imp_kv_blocks_free", "imp_kv_blocks_used", "imp_kv_blocks_reserved",
    "imp_kv_blocks_cached", "imp_kv_blocks_pinned", "imp_decode_batch_last_rows", "imp_decode_batch_max",
]
HISTOGRAMS = ["imp_request_duration_seconds", "imp_ttft_seconds", "imp_queue_time_seconds", "imp_inter_token_seconds"]
ENDPOINT_HISTOGRAMS = ["imp_endpoint_" + h[len("imp_"):] for h in HISTOGRAMS]

T0 = 1_780_000_000_000_000_000
MS = 1_000_000


def samples(m: MetricsActor) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: MetricsActor, name: str, **labels) -> float:
    return samples(m)[(name, tuple(sorted(labels.items())))]


def kv(free=64, used=0, reserved=0, cached=0, evictions=0, inflight_waits=0, **more):
    return KvFigures(64, free, used, reserved, cached, 16, evictions, inflight_waits=inflight_waits, **more)


def actor(**kw) -> MetricsActor:
    return MetricsActor(Bus(EventLog(None)), "smollm2-135m", kv(), **{"kv_block_bytes": 1000, **kw})


def req(endpoint="chat_completions", status=200, **kw) -> RequestStats:
    base = dict(prompt_tokens=10, completion_tokens=5, cached_tokens=2, ttft_s=0.05, duration_s=0.1,
                finish="stop", itl_s=(0.01, 0.02), arrival_unix_ns=T0, queue_end_unix_ns=T0 + 20 * MS,
                first_token_unix_ns=T0 + 50 * MS, end_unix_ns=T0 + 100 * MS)
    base.update(kw)
    return RequestStats(endpoint, status, **base)


def test_every_series_exists_at_zero_before_traffic():
    m = actor()
    s = samples(m)
    for name in COUNTERS + GAUGES:
        assert (name, ()) in s, name
    for name in COUNTERS + [g for g in GAUGES if not g.startswith("imp_kv_blocks_")]:
        assert s[(name, ())] == 0, name
    assert s[("imp_kv_blocks_total", ())] == 64 and s[("imp_kv_blocks_free", ())] == 64
    for h in HISTOGRAMS:
        assert s[(h + "_count", ())] == 0 and (h + "_bucket", (("le", "+Inf"),)) in s, h
    assert set(ENDPOINTS) == {"chat_completions", "completions", "messages", "infill", "responses", "embeddings",
                              "rerank", "score"}
    for ep in ENDPOINTS:
        assert s[("imp_endpoint_requests_total", (("endpoint", ep),))] == 0, ep
        for h in ENDPOINT_HISTOGRAMS:
            assert s[(h + "_count", (("endpoint", ep),))] == 0, (h, ep)
    assert s[("imp_model_loaded", (("model", "smollm2-135m"),))] == 1
    # the two things imp never does say so where a scraper reads them
    text = m.exposition().decode()
    for name in ("imp_kv_pool_growths_total", "imp_streaming_kv_auto_enables_total"):
        assert f"# HELP {name} " in text and "always 0" in text.split(f"# HELP {name} ")[1].split("\n")[0]


async def test_messages_move_every_series():
    m = actor()
    # a step of 3 rows, then a queue with work
    await m.on_message("scheduler", StepStats(1, 3, 40, 2, 20_000_000))
    await m.on_message("scheduler", StepStats(2, 2, 2, 2, 10_000_000))
    await m.on_message("scheduler", Figures(kv(free=40, used=24, reserved=30, cached=8, evictions=3, inflight_waits=2,
                                               swap_blocks=100, swap_used=7, swaps_out=2, swaps_in=1, swap_copies=9,
                                               tier_saves=4, tier_hits=3, tier_host_hits=2),
                                            QueueFigures(1, 2, 120, preemptions=1, cancellations=2, timeouts=1)))
    assert (value(m, "imp_kv_swaps_total"), value(m, "imp_kv_swap_ins_total"), value(m, "imp_kv_swap_blocks_used")) \
        == (2, 1, 7)
    assert (value(m, "imp_kv_swap_bytes_total"), value(m, "imp_kv_tier_written_bytes_total"),
            value(m, "imp_kv_tier_read_bytes_total"), value(m, "imp_kv_tier_host_hits_total")) == (9000, 4000, 3000, 2)
    assert value(m, "imp_decode_batch_last_rows") == 2 and value(m, "imp_decode_batch_max") == 3
    assert value(m, "imp_decode_batch_steps_total") == 2 and value(m, "imp_decode_batch_rows_total") == 5
    assert (value(m, "imp_queue_waiting"), value(m, "imp_queue_running"), value(m, "imp_queue_depth"),
            value(m, "imp_queued_prompt_tokens")) == (1, 2, 3, 120)
    assert (value(m, "imp_kv_blocks_reserved"), value(m, "imp_kv_blocks_used"), value(m, "imp_kv_blocks_cached")) == (30, 24, 8)
    assert value(m, "imp_prefix_cache_evictions_total") == 3 and value(m, "imp_preemptions_total") == 1
    assert value(m, "imp_requests_cancelled_total") == 2 and value(m, "imp_requests_timed_out_total") == 1
    # counters move by the difference of the scheduler's running totals
    await m.on_message("scheduler", Figures(kv(evictions=5), QueueFigures(0, 0, 0, 1, 3, 1)))
    assert value(m, "imp_prefix_cache_evictions_total") == 5 and value(m, "imp_requests_cancelled_total") == 3
    assert value(m, "imp_prefix_cache_inflight_waits_total") == 2  # a figure without the field: no move
    assert value(m, "imp_decode_batch_last_rows") == 0  # idle: nothing running
    assert value(m, "imp_decode_batch_max") == 3  # never resets

    # every generation path feeds the four histograms, totals and per endpoint
    for ep in ENDPOINTS:
        await m.on_message("ingress", req(ep))
    n = len(ENDPOINTS)
    assert value(m, "imp_requests_total") == n
    assert value(m, "imp_tokens_generated_total") == 5 * n and value(m, "imp_tokens_prompt_total") == 10 * n
    assert value(m, "imp_tokens_cached_total") == 2 * n
    assert value(m, "imp_request_duration_seconds_count") == n and value(m, "imp_inter_token_seconds_count") == 2 * n
    assert value(m, "imp_queue_time_seconds_sum") == pytest.approx(0.02 * n)  # arrival -> first batch
    assert value(m, "imp_ttft_seconds_sum") == pytest.approx(0.05 * n)
    for ep in ENDPOINTS:
        assert value(m, "imp_endpoint_requests_total", endpoint=ep) == 1
        for h in ENDPOINT_HISTOGRAMS:
            assert value(m, h + "_count", endpoint=ep) == (2 if "inter_token" in h else 1), (h, ep)

    # cancelled before its first batch: its wait is queue time, and it has no ttft
    await m.on_message("ingress", req(completion_tokens=0, ttft_s=0.0, itl_s=(), queue_end_unix_ns=0,
                                      first_token_unix_ns=0, finish="cancelled"))
    assert value(m, "imp_queue_time_seconds_sum") == pytest.approx(0.02 * n + 0.1)
    assert value(m, "imp_ttft_seconds_count") == n

    # refusals: counted, never timed; one whose prompt exceeds the pool is a KV refusal
    await m.on_message("ingress", req(status=429, reject_code="rate_limit_exceeded", ttft_s=0.0, itl_s=()))
    await m.on_message("ingress", req(status=400, reject_code="context_length_exceeded", prompt_tokens=64 * 16,
                                      completion_tokens=0, ttft_s=0.0, itl_s=()))
    await m.on_message("ingress", req(status=400, reject_code="context_length_exceeded", prompt_tokens=100,
                                      completion_tokens=0, ttft_s=0.0, itl_s=()))  # the model's context, not KV
    assert value(m, "imp_kv_pressure_rejections_total") == 1
    assert value(m, "imp_requests_total") == n + 4 and value(m, "imp_request_duration_seconds_count") == n + 1

    # the OTLP counters are the exporter's; faults count
    m.otlp.spans_exported.inc(4)
    m.otlp.export_failures.inc()
    m.otlp.unsampled.inc()
    await m.on_message("executor", Fault("executor", "boom"))
    assert value(m, "imp_otlp_spans_exported_total") == 4 and value(m, "imp_otlp_export_failures_total") == 1
    assert value(m, "imp_otlp_unsampled_requests_total") == 1 and value(m, "imp_actor_faults_total") == 1
    assert m.faults == ["boom"]


def test_boot_prefill_rate_seeds_the_estimate_until_a_prefill_runs():
    assert Rates().prefill_tok_s_recent is None
    r = Rates(boot_prefill_tok_s=800.0)
    assert r.prefill_tok_s_recent == 800.0 and r.snapshot(0.0)["prefill_tok_s_recent"] == 800.0
    assert r.snapshot(0.0)["prefill_tok_s_lifetime"] is None  # the lifetime figure is traffic only
    r.observe(StepStats(1, 1, 100, 0, 500_000_000), 1.0)
    assert r.prefill_tok_s_recent == 200.0
    assert actor(boot_prefill_tok_s=500.0).rates.prefill_tok_s_recent == 500.0


async def test_data_parallel_figures_are_summed():
    m = MetricsActor(Bus(EventLog(None)), "m", kv(), sources=["scheduler.0", "scheduler.1"])
    assert value(m, "imp_kv_blocks_total") == 128
    await m.on_message("scheduler.0", Figures(kv(free=60, used=4), QueueFigures(1, 1, 10, cancellations=1)))
    await m.on_message("scheduler.1", Figures(kv(free=50, used=14), QueueFigures(0, 3, 0, cancellations=2)))
    assert value(m, "imp_kv_blocks_used") == 18 and value(m, "imp_queue_depth") == 5
    assert value(m, "imp_requests_cancelled_total") == 3
    # the KV refusal is judged against one replica's pool (a stream lives in one)
    await m.on_message("ingress", req(status=400, reject_code="context_length_exceeded", prompt_tokens=64 * 16))
    assert value(m, "imp_kv_pressure_rejections_total") == 1


async def test_ignored_fields_are_counted_by_endpoint_and_field_with_bounded_labels():
    m = actor()
    await m.on_message("ingress", req(ignored_fields=("frobnicate", "other")))
    await m.on_message("ingress", req("messages", ignored_fields=("frobnicate",)))
    r = m.registry
    get = lambda ep, f: r.get_sample_value("imp_ignored_fields_total", {"endpoint": ep, "field": f})  # noqa: E731
    assert get("chat_completions", "frobnicate") == 1 and get("chat_completions", "other") == 1
    assert get("messages", "frobnicate") == 1
    for i in range(100):  # a client inventing names cannot grow the label set past 64
        await m.on_message("ingress", req(ignored_fields=(f"f{i}",)))
    names = {s.labels["field"] for fam in r.collect() if fam.name == "imp_ignored_fields" for s in fam.samples}
    assert len(names) <= 65 and get("chat_completions", "other") > 1
