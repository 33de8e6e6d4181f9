"""Runs in a child process: plain vLLM or governed vLLM (multiprocess mode) on given prompts.

Usage: python -m tests.engine_adapter.vllm_child {plain|governed-mp} WORKDIR PROMPTS_JSON OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    mode, workdir, prompts_file, out_file = sys.argv[1:5]
    from vllm import LLM, SamplingParams  # noqa: PLC0415 (after argument parsing: import is slow)

    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    items = json.loads(Path(prompts_file).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    result: dict[str, object] = {}
    if mode == "plain":
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        llm = LLM(model=str(tiny_llama_dir()), enable_prefix_caching=True, **engine_kwargs())
        outs = [
            llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
            for _, p in items
        ]
    else:
        options = GuardOptions(**write_secrets(Path(workdir)))
        g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
        result["in_process"] = g.connector is not None
        outs = [g.generate([p], params, tenant=t)[0] for t, p in items]
        g.llm.llm_engine.engine_core.shutdown()
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    result["cached"] = [o.num_cached_tokens for o in outs]
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
