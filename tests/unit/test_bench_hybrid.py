"""bench-hybrid's workload and summary: long requests at fixed times among Poisson short ones, the same for
every strategy; TTFTs of short and long requests apart; merged instances counted from the cluster samples."""

from services.tools.bench.client import ClusterSample, RequestRecord
from services.tools.bench.hybrid import hybrid_requests, merged_instances, parse_args, summary


def test_the_workload_is_short_requests_at_a_steady_rate_and_a_long_one_every_so_often():
    args = parse_args(["--duration", "60", "--long-every", "20", "--short-rate", "2", "--long-tokens", "900,8"])
    requests = hybrid_requests(args)
    assert requests == hybrid_requests(args)  # the same for every strategy
    assert [r.arrival_s for r in requests if r.prompt_tokens == 900] == [10.0, 30.0, 50.0]
    shorts = [r for r in requests if r.prompt_tokens == 64]
    assert 90 <= len(shorts) <= 150 and all(r.output_tokens == 32 for r in shorts)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)


def test_the_summary_keeps_short_and_long_requests_apart():
    def record(i, prompt, ttft, error=None):
        return RequestRecord(i, float(i), prompt, 4, sent_s=float(i), chunk_s=[i + ttft], completion_tokens=4,
                             done_s=i + ttft + 1, error=error)

    records = [record(0, 64, 0.5), record(1, 64, 1.5), record(2, 900, 10.0), record(3, 64, 0.1, error="HTTP 503")]
    samples = [ClusterSample(0.0, [{"instance": "i0"}, {"instance": "i1"}]),
               ClusterSample(1.0, [{"instance": "tp-exec0-exec1"}, {"instance": "tp-exec0-exec1"}])]
    out = summary(records, samples, long_prompt=900)
    assert (out["failed"], out["errors"]) == (1, ["HTTP 503"])
    assert out["long_ttft_p50"] == 10.0 and out["short_ttft_p50"] == 0.5  # the failed one had a first token
    assert out["max_merged_instances"] == 1 and out["merged_share"] == 0.5
    assert merged_instances(samples[0]) == 0
