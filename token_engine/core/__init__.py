"""The engine core: the step loop (`engine.py`), scheduler and its per-step token budget (`step_budget.py`), block
manager (`kv_cache.py`), model runner, sampler, sequence, CUDA graphs."""
