"""Rollout engines behind one contract (:mod:`rlpipe.inference.contract`): the embedded CPU
engine, and clients of engines that run as their own servers (vLLM, SGLang's protocol)."""
