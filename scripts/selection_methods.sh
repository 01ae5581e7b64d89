# The selection methods, named in full so that a later change of the defaults does not change what a
# resumed run measures (sourced by scripts/frontier.sh and scripts/gpu_check.sh).
# FIRST: the first default, each chunk's first r. DEFAULT: the first default with the question's
# signal (`spread`), chunk starts, then up to 4 tokens per chunk where the question attends in the first
# 4 layers. The candidates measured to replace it: CANDIDATE, the same over 6 layers; STARTS, its chunk
# starts alone, without the question's pass; FOCUS, the rest shared among chunks by the question's
# attention mass, the engine's shallow selection now. Its start share is 0.8 (0.75 cost 1.10x
# `first`'s TTFT on SmolLM2 MuSiQue rows 100-119; the 0.75 rows stay in the progress files under their
# own name).
FIRST=cachetune:first:allocation=proportional:signal=none
DEFAULT=cachetune:first:allocation=spread:start_share=0.75:signal=question:signal_layers=4:signal_tokens=4
CANDIDATE=cachetune:first:allocation=spread:start_share=0.75:signal=question:signal_layers=6:signal_tokens=4
STARTS=cachetune:first:allocation=spread:start_share=0.75:signal=none
FOCUS=cachetune:first:allocation=focus:start_share=0.8:signal=question:signal_layers=4:signal_tokens=4
# D28: deep focus, the question read over all 28 of Qwen2.5-1.5B's layers in
# bfloat16, focus's shape at start share 0.5 with no cap per chunk (what `deep_within` runs on Qwen).
D28=cachetune:first:allocation=focus:start_share=0.5:signal=question:signal_layers=28:signal_tokens=none:signal_dtype=bfloat16
# The methods the first bar orders, and the reference points beside them.
BAR_METHODS=full_reuse,epic,cacheblend,prophetkv,$FIRST,$DEFAULT,$CANDIDATE,$STARTS,$FOCUS
