"""The papers' reported numbers (../shared/SPEC.md), keyed by preset name: targets, not results."""

# ResNet18 / CIFAR-10 test accuracy %, (compression off at eval, on at eval); Rudakov et al. Tables 1-4
RESNET = {
    "baseline": (93.0, 93.0),
    "fw4-bw8": (93.10, 92.95), "fw4-bw6": (91.93, 91.76), "fw4-bw4": (83.39, 82.66), "fw4-bw2": (65.11, 64.27),
    "fw2-bw8": (77.09, 92.05), "fw2-bw6": (84.87, 91.59), "fw2-bw4": (81.32, 83.92),
    "top50": (93.16, 93.38), "top30": (91.26, 93.06), "top20": (86.74, 92.73), "top10": (75.89, 91.87),
    "top5": (55.09, 90.01), "top2": (49.95, 85.52),
    "ef-top10-base20": (91.02, 89.85), "efmixed-top10-base20": (61.37, 90.97), "ef21-top5": (89.37, 89.29),
    "ef21-top10": (90.83, 91.19), "ef21-top10-base20": (90.71, 91.77),
    "aqsgd-top50-base10": (92.44, 92.54), "aqsgd-top30-base10": (91.86, 91.61),
    "aqsgd-top20-base10": (90.82, 87.8), "aqsgd-top10-base10": (85.91, 84.16),
}

# GPT-2 small / Wikitext-2 eval loss (perplexity); Rudakov et al. Table 5
GPT2 = {
    "baseline": (3.05, 21.01), "top50-reuse": (3.11, 22.38), "top30-reuse": (3.27, 26.28),
    "top20-reuse": (3.51, 33.32), "top10-reuse": (4.31, 74.51), "top10-separate": (8.0, 2990.0),
}

# AQ-SGD (Wang et al.) training throughput at 100 Mbps, GPT2-1.5B in 8 stages, in the units of its Table 2,
# and its end-to-end speed-ups (SPEC.md; issue 28 ties them to fw3-bw6 at 100 Mbps), keyed by (method,
# bandwidth in bits/s) as `benchmarks.throughput_vs_bandwidth` names its rows
AQSGD_THROUGHPUT = {
    ("fp32", 100e6): "0.5",
    ("aqsgd-fw3-bw6", 100e6): "3.4 (up to 4.3x end-to-end)",
    ("aqsgd-fw3-bw6 + QuantizedAdam", 100e6): "up to 4.9x end-to-end",
}

# AQ-SGD's Table 2: fp32's training throughput (GPT2-1.5B, 8 stages, its units) at 10 Gbps, 1 Gbps, 500, 300 and
# 100 Mbps; AQ-SGD fw3-bw6's at 10 Gbps (3.4 at 100 Mbps); its end-to-end speed-up at 100 Mbps in time to the same loss
AQSGD_FP32_THROUGHPUT = {"10gbps": 3.8, "1gbps": 3.2, "500mbps": 2.7, "300mbps": 1.8, "100mbps": 0.5}
AQSGD_10GBPS_THROUGHPUT = 4.0
AQSGD_SPEEDUP = 4.3

# Protocol NanoGPT's published records (github PluralisResearch/ProtocolNanoGPT, records/*/README.md and log.txt; n=1,
# 8 x H100, every boundary metered at 200 Mb/s + 50 ms per message on the receiver's one inbound wire): the first
# validated step at or below 3.276, the steady-state step time over the links, bytes per token over a boundary both
# ways, 1F1B microbatches, T = steps x step time, and the step unmetered: the loss run's (WAN_MODE=off) step_avg over
# the 25 steps that reached the target (log.txt: 539.45 ms at step 2925; 658.07 ms at step 9125)
PROTOCOL_TARGET_LOSS = 3.276
PROTOCOL_RECORDS = {
    "dense-bf16": dict(steps=2925, step_s=100.475, bytes_per_token=4096, microbatches=64, T=293889.4,
                       unmetered_step_s=0.53945),
    "reparamssn": dict(steps=9125, step_s=19.889, bytes_per_token=644, microbatches=32, T=181487.1,
                       unmetered_step_s=0.65807),
}
# How many times its unmetered step the dense record's step takes on the meter: 186.3 (the link, not compute, is
# 99.5% of it)
PROTOCOL_DENSE_SLOWDOWN = PROTOCOL_RECORDS["dense-bf16"]["step_s"] / PROTOCOL_RECORDS["dense-bf16"]["unmetered_step_s"]
# The meter's latency as a share of one dense message's transfer (train_gpt.py: 50 ms against 8 x 1024 tokens x 1024
# bf16 = 16,777,216 bytes at 200 Mb/s): 0.0745
PROTOCOL_LATENCY_SHARE = 0.05 / (8 * 16_777_216 / 200e6)

RESNET_FAMILIES = (("fw", "quantization"), ("top", "TopK"), ("ef", "error feedback"), ("aqsgd", "AQ-SGD+TopK"))


def resnet_row(preset: str) -> str:
  """The Rudakov et al. ResNet18 / CIFAR-10 row a preset reproduces."""
  off, on = RESNET[preset]
  family = next((name for prefix, name in RESNET_FAMILIES if preset.startswith(prefix)), "no compression")
  return f"Rudakov et al., {family}: test acc {off} off / {on} on"


def gpt2_row(preset: str) -> str:
  """The Rudakov et al. (Table 5) or AQ-SGD (Wang et al.) GPT-2 row a preset reproduces."""
  if preset in GPT2:
    loss, ppl = GPT2[preset]
    return f"Rudakov et al. Table 5 (GPT-2 small fine-tuned): eval loss {loss}, ppl {ppl}"
  bits = preset.split("-")[1:3]
  if preset.endswith("-warm1"):
    return f"not in the papers: direct {'-'.join(bits)} after AQ-SGD's dense first epoch (warm-up without buffer)"
  if preset.startswith("aqsgd"):
    return f"Wang et al. (AQ-SGD, GPT2-1.5B, 8 stages): {'-'.join(bits)} converges like fp32"
  return f"Wang et al. (AQ-SGD's baseline): direct quantization {'-'.join(bits)} diverges or lags fp32"
# Protocol NanoGPT's ReparamSSN record against its dense record, both WAN_MODE=off loss runs (their logs, validation
# every 125 steps, linear interpolation between logged points): the steps SSN takes to dense's eval loss at dense's
# step D, over D (the two runs decay their learning rates over their own horizons, 3,000 and 9,500 steps)
SSN_RECORD_INFLATION = {250: 1.66, 500: 1.80, 1000: 1.95, 1500: 2.61, 2000: 3.06, 2925: 3.13}
