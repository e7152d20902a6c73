"""Agentic rollouts (SPEC R5, seed 5.1-5.4): agent loops that wrap any rollout engine.

- :mod:`rlpipe.agents.loop`: episodes as state machines, :class:`~rlpipe.agents.loop.AgentEngine`
  (an agent *is* a RolloutEngine over the replica's engine) and the ``agent`` registry;
- :mod:`rlpipe.agents.tool_agent`: ``tool_agent``, the multi-turn tool-calling loop;
- :mod:`rlpipe.agents.tools`, :mod:`rlpipe.agents.tool_types`, :mod:`rlpipe.agents.sandbox`,
  :mod:`rlpipe.agents.parsers`: tools and call formats;
- :mod:`rlpipe.agents.gateway`, :mod:`rlpipe.agents.openai_format`, :mod:`rlpipe.agents.chat`: the
  OpenAI-compatible gateway (its wire format, its token-level session records);
  :mod:`rlpipe.agents.gateway_agent`: the ``gateway`` agent running agent programs
  (:mod:`rlpipe.agents.programs`: the ``agent_program`` registry and the built-in programs) against it.
"""
