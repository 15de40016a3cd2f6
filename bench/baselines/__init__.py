"""Hand-written baselines the benchmarks compare dptrain against (plain torch, nothing of ours)."""
