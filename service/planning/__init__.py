"""Deciding where and how a job runs: candidates, cost model, sync choice, the hardware figures behind them."""
