"""Where kvguard meets a serving engine.

Owns: the engine-agnostic custody core (block ownership state machine, conservation invariant G4) and
one adapter per engine (vLLM first). Never holds business policy: it asks `kvguard.policy`.
"""
