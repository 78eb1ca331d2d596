"""The names rtrace.compat.open_instruct relies on, read out of an open-instruct checkout.

open-instruct is not on PyPI and its rollout path imports vLLM, olmo_core and deepspeed, so
no test here can import it. What a test can check honestly is that every name the adapter
and docs/frameworks/open-instruct.md use exists, with the fields and parameters they
assume, in the real code: this module extracts them with ``ast`` (nothing is imported or
run) into ``open_instruct_names.json``, committed beside it with the commit it was read at.

    python tests/frameworks/open_instruct_names.py /path/to/open-instruct   # rewrite the JSON
    OPEN_INSTRUCT_DIR=/path/to/open-instruct pytest tests/frameworks/test_open_instruct.py  # compare
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "open_instruct_names.json"

#: (file, class) -> dataclass fields; (file, function) -> parameters
CLASSES = [("open_instruct/data_types.py", "GenerationResult"), ("open_instruct/data_types.py", "RequestInfo"),
           ("open_instruct/data_types.py", "PromptRequest"), ("open_instruct/model_utils.py", "Batch"),
           ("open_instruct/data_types.py", "ToolCallStats"), ("open_instruct/data_types.py", "EnvConfig"),
           ("open_instruct/data_types.py", "EnvConfigEntry")]
FUNCTIONS = [("open_instruct/data_loader.py", "accumulate_inference_batches"),
             ("open_instruct/grpo_utils.py", "maybe_evaluate"),
             ("open_instruct/data_loader.py", "DataPreparationActor._data_preparation_loop"),
             ("open_instruct/data_loader.py", "process_group"),
             ("open_instruct/data_loader.py", "result_is_stale"),
             ("open_instruct/data_loader.py", "_merge_env_config"),
             ("open_instruct/data_loader.py", "maybe_mask_truncated_completions"),
             # the weight broadcast rtrace marks, and its two callers (where the step is)
             ("open_instruct/grpo_utils.py", "perform_weight_sync"),
             ("open_instruct/grpo_fast.py", "weight_sync_thread"),
             ("open_instruct/grpo_callbacks.py", "VLLMWeightSyncCallback.post_step")]
#: dataclass fields whose defaults the docs state: (file, class, field)
DEFAULTS = [("open_instruct/data_loader.py", "StreamingDataLoaderConfig", "filter_zero_std_samples"),
            ("open_instruct/data_loader.py", "StreamingDataLoaderConfig", "mask_tool_use"),
            ("open_instruct/data_loader.py", "StreamingDataLoaderConfig", "async_steps"),
            ("open_instruct/data_loader.py", "StreamingDataLoaderConfig", "mask_truncated_completions"),
            # the role an environment's observations are inserted with, by class
            ("open_instruct/environments/base.py", "RLEnvironment", "response_role"),
            ("open_instruct/environments/base.py", "TextRLEnvironment", "response_role")]


def _fields(tree: ast.Module, name: str) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    raise KeyError(name)


def _function(tree: ast.Module, dotted: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in dotted.split("."):
        node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and n.name == part)
        scope = node.body
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    return node


def _calls(fn: ast.AST, name: str) -> list[str]:
    """Every call of ``name`` (a function or method, by its dotted spelling) in ``fn``, as
    written, in source order."""
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == name]
    return [ast.unparse(n) for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def _default(tree: ast.Module, cls: str, name: str) -> str:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for s in node.body:
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == name:
                    return ast.unparse(s.value) if s.value is not None else ""
    raise KeyError(f"{cls}.{name}")


def extract(root: Path) -> dict:
    out: dict = {"classes": {}, "functions": {}, "calls": {}, "defaults": {}}
    trees = {}
    for path, *_ in CLASSES + FUNCTIONS + DEFAULTS + [("open_instruct/grpo_fast.py", "main"),
                                                      ("open_instruct/vllm_utils.py", "LLMRayActor"),
                                                      ("open_instruct/vllm_utils.py", "process_tool_tokens")]:
        if path not in trees:
            trees[path] = ast.parse((root / path).read_text())
    for path, name in CLASSES:
        out["classes"][name] = _fields(trees[path], name)
    for path, dotted in FUNCTIONS:
        fn = _function(trees[path], dotted)
        args = fn.args
        out["functions"][dotted] = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        # how accumulate_inference_batches is called there, and what the loop reads
        calls = sorted({ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)
                        and ast.unparse(n.func).endswith(("accumulate_inference_batches", "process_group",
                                                          "result_is_stale"))})
        attrs = sorted({ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                        and ast.unparse(n).startswith(("self.training_step", "self.config.num_samples_per_prompt"))})
        if calls or attrs:
            out["calls"][dotted] = {"calls": calls, "attributes": attrs}
        if dotted == "process_group":  # the conditions under which it returns None (drops the group)
            out["process_group_returns_none_if"] = sorted(
                ast.unparse(n.test) for n in ast.walk(fn) if isinstance(n, ast.If) and any(
                    isinstance(r, ast.Return) and isinstance(r.value, ast.Constant) and r.value.value is None
                    for r in n.body))
    loader = trees["open_instruct/data_loader.py"]
    loop = _function(loader, "DataPreparationActor._data_preparation_loop")
    accumulate = _function(loader, "accumulate_inference_batches")
    # what the data preparation loop does with the batch: the staleness bound it passes, the
    # truncation filter after the call, the conditions on which it gathers the step again
    (call,) = [n for n in ast.walk(loop) if isinstance(n, ast.Call) and ast.unparse(n.func) == "accumulate_inference_batches"]
    out["loop_max_result_age_steps"] = [ast.unparse(k.value) for k in call.keywords if k.arg == "max_result_age_steps"]
    out["loop_truncation_calls"] = _calls(loop, "maybe_mask_truncated_completions")
    out["loop_gathers_again_if"] = [ast.unparse(n.test) for n in ast.walk(loop) if isinstance(n, ast.If)
                                    and isinstance(n.body[-1], ast.Continue)]
    out["stale_checks"] = _calls(accumulate, "result_is_stale")
    out["result_is_stale_returns"] = [ast.unparse(n.value) for n in ast.walk(_function(loader, "result_is_stale"))
                                      if isinstance(n, ast.Return)]
    out["truncation_keeps"] = [ast.unparse(n) for n in ast.walk(_function(loader, "maybe_mask_truncated_completions"))
                               if isinstance(n, ast.ListComp) and "finish_reasons" in ast.unparse(n)]
    # the Ray actor: @ray.remote leaves the module's name bound to Ray's wrapper, so Ray
    # pickles the class (and its methods' globals) by value
    out["data_preparation_actor_decorators"] = [
        ast.unparse(d) for n in loader.body if isinstance(n, ast.ClassDef) and n.name == "DataPreparationActor"
        for d in n.decorator_list]
    # text environments: a shadow call to each after the parsed tool calls; the roles the
    # observations are inserted with; the per-call stats; how the run marks a text env
    vllm = ast.parse((root / "open_instruct/vllm_utils.py").read_text())
    request = _function(vllm, "process_request")
    out["process_request_tool_calls"] = [ast.unparse(n) for n in sorted(
        (n for n in ast.walk(request) if (isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "tool_calls")
         or (isinstance(n, ast.Call) and ast.unparse(n.func) == "tool_calls.append")),
        key=lambda n: (n.lineno, n.col_offset))]
    out["process_request_observations"] = _calls(request, "observations.append")
    out["process_request_call_stats"] = _calls(request, "rollout.tool_call_stats.append")
    fast = trees["open_instruct/grpo_fast.py"]
    out["base_env_config_entries"] = _calls(_function(fast, "build_base_env_config"), "EnvConfigEntry")
    for path, cls, name in DEFAULTS:
        out["defaults"][f"{cls}.{name}"] = _default(trees[path], cls, name)
    # the dataset keys the data loader module imports (INPUT_IDS_PROMPT_KEY: process_group's query)
    out["data_loader_imports"] = sorted({a.asname or a.name for n in trees["open_instruct/data_loader.py"].body
                                         if isinstance(n, ast.ImportFrom)
                                         and n.module == "open_instruct.dataset_transformation" for a in n.names})
    # grpo_fast.main's ray.init: the runtime_env keys and how env_vars is built
    main = _function(trees["open_instruct/grpo_fast.py"], "main")
    (init,) = [n for n in ast.walk(main) if isinstance(n, ast.Call) and ast.unparse(n.func) == "ray.init"]
    (env,) = [k.value for k in init.keywords if k.arg == "runtime_env"]
    out["ray_init_runtime_env"] = {ast.unparse(k): ast.unparse(v) for k, v in zip(env.keys, env.values)}
    out["excluded_env_vars"] = [ast.unparse(n.value) for n in trees["open_instruct/grpo_fast.py"].body
                                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "EXCLUDED_ENV_VARS"]
    # the loss mask a tool's output gets (vllm_utils.process_tool_tokens)
    tool = _function(trees["open_instruct/vllm_utils.py"], "process_tool_tokens")
    out["tool_output_masks"] = [ast.unparse(n) for n in ast.walk(tool) if isinstance(n, ast.Assign)
                                and ast.unparse(n.targets[0]) == "masks"]
    # the logprobs a tool's output gets, and the one of the end token added to an empty response
    out["tool_output_logprobs"] = [ast.unparse(n) for n in ast.walk(tool) if isinstance(n, ast.Assign)
                                   and ast.unparse(n.targets[0]) == "logprobs"]
    out["empty_response_logprobs"] = sorted({ast.unparse(n) for n in ast.walk(trees["open_instruct/data_loader.py"])
                                             if isinstance(n, ast.Call)
                                             and ast.unparse(n.func) == "result.logprobs[i].append"})
    out["weight_sync"] = _weight_sync(root, trees)
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except Exception:
        commit = None
    out["commit"] = commit
    return out


def _weight_sync(root: Path, trees: dict[str, ast.Module]) -> dict:
    """Where open-instruct publishes new weights and which step its engines stamp afterwards:
    every caller of ``perform_weight_sync`` in the package, how each gets the step it sends,
    what ``perform_weight_sync`` does before it returns, and where a vLLM engine sets and
    stamps its ``model_step``."""
    callers = []
    for path in sorted((root / "open_instruct").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(n, ast.Call) and ast.unparse(n.func).endswith("perform_weight_sync")
                    for n in ast.walk(node)) and node.name != "perform_weight_sync":
                callers.append(f"{path.relative_to(root)}:{node.name}")
    thread = _function(trees["open_instruct/grpo_fast.py"], "weight_sync_thread")
    post_step = _function(trees["open_instruct/grpo_callbacks.py"], "VLLMWeightSyncCallback.post_step")
    sync = _function(trees["open_instruct/grpo_utils.py"], "perform_weight_sync")
    vllm = trees["open_instruct/vllm_utils.py"]
    actor = next(n for n in vllm.body if isinstance(n, ast.ClassDef) and n.name == "LLMRayActor")
    return {
        "callers": sorted(set(callers)),
        "thread_step": [ast.unparse(n) for n in ast.walk(thread) if isinstance(n, ast.Assign)
                        and ast.unparse(n.targets[0]) == "target_model_step"],
        "thread_calls": _calls(thread, "m.broadcast_to_vllm.remote") + _calls(thread, "grpo_utils.perform_weight_sync"),
        "callback_calls": _calls(post_step, "vllm_utils.broadcast_weights_to_vllm")
        + _calls(post_step, "grpo_utils.perform_weight_sync"),
        # the remote calls it makes, in order: the actors paused, the engines woken, the actors resumed
        "perform_remote_calls": [ast.unparse(n) for n in sorted(
            (n for n in ast.walk(sync) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(".remote")),
            key=lambda n: (n.lineno, n.col_offset))],
        "engine_sets_model_step": sorted(
            f"{fn.name}: {ast.unparse(n)}" for fn in actor.body if isinstance(fn, ast.FunctionDef)
            for n in ast.walk(fn) if isinstance(n, ast.Assign)
            and ast.unparse(n.targets[0]) == "self.current_model_step"),
        "request_stamps": sorted(f"{ast.unparse(k)}: {ast.unparse(v)}" for n in ast.walk(_function(vllm, "add_request"))
                                 if isinstance(n, ast.Dict) for k, v in zip(n.keys, n.values)
                                 if k is not None and ast.unparse(k) == "'model_step'"),
    }


if __name__ == "__main__":
    data = extract(Path(sys.argv[1]))
    MANIFEST.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"wrote {MANIFEST} (open-instruct {data['commit']})")
