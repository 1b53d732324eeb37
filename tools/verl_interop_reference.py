"""Record verl's own rows for dew's verl interop: a gsm8k tool-agent parquet and AgentLoopOutput dumps.

Run in the reference environment from the repository root (verl goes in without its
dependencies, with the few its agent loop imports; tools/requirements-ref.txt says how):

    .venv-ref/bin/python tools/verl_interop_reference.py

Writes

- ``tests/fixtures/verl_gsm8k_tool_agent_loop.parquet``: four rows in the layout of verl's
  ``examples/data_preprocess/gsm8k_tool_agent_loop.py`` (volcengine/verl at 030a519, read
  with the search tool: the script is not in the wheel). Its ``process_fn`` is repeated
  here line for line and run through ``datasets`` ``map(..., with_indices=True)`` and
  ``to_parquet`` as the script does, over four synthetic gsm8k-shaped records, since the
  real dataset cannot be downloaded here.
- ``tests/fixtures/verl_rows.json``: AgentLoopOutput rows as ``model_dump()`` writes them
  (tensors and arrays as nested lists), with ``meta``:

  * ``tool_loop``: four rows from verl's own ``ToolAgentLoop.run`` (the "tool_agent"
    loop the parquet names), two samples each of the parquet's first two prompts in the
    order verl repeats them for ``rollout.n = 2``. The loop talks to a scripted engine
    (what vLLM would return: token ids, float32 log-probabilities, a router record over
    every id it read and drew, and ``min/max_global_steps`` as verl's fully-async
    rollouts report them) and calls a ``calc_gsm8k_reward`` BaseTool that follows verl's
    ``verl/tools/gsm8k_tool.py`` (2066bae; the 0.9.1 wheel no longer ships it) on the
    0.9.1 BaseTool interface, created from the row's ``tools_kwargs``. The tokenizer is
    the real Qwen3 vocabulary and chat template (tools/qwen3_vocab.py), with verl's
    Qwen3 Continuous Token builder. ``reward_score`` is verl's
    ``verl.utils.reward_score.gsm8k.compute_score`` of the decoded response, set on the
    output the way an agent loop that scores itself does (verl's reward-loop workers are
    Ray actors this tool does not start).
  * ``video``: one single-turn video row. Its ``mm_processor_output`` comes from verl's
    own ``AgentLoopBase.build_sglang_video_payload``. What that builder wraps, the
    processor's ``pixel_values_videos`` and ``video_grid_thw``, is substituted: Qwen2-VL's
    video processor needs torchvision, and PyPI's torchvision wheels do not load against
    the CPU torch wheel here (``operator torchvision::nms does not exist``), so the tool
    writes seeded tensors of the shapes that processor gives two 28x28 frames (grid
    1x2x2, one merged ``<|video_pad|>`` id).

- ``tests/fixtures/verl_rows.npz``: for every row its ``as_dict()`` tensors
  (``<set>_<i>_<key>``), and for the tool-loop rows the batch verl's
  ``AgentLoopWorker`` builds from them (``_agent_loop_postprocess`` then
  ``_postprocess``: left-padded prompts, right-padded responses, ``input_ids``,
  ``attention_mask``, ``position_ids``, ``rollout_log_probs``, ``routed_experts``,
  ``rm_scores``), as ``batch_<key>``.

verl is the 0.9.1 wheel from PyPI. The spec names revision
12ebe0cb4d300c58449fb6c675379e8700015c51, which is not installable here (no network beyond
the package registries, and no wheel of that commit); ``meta`` says so.
"""

import asyncio
import copy
import json
import re
import sys
import types
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
import verl
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, AgentLoopWorker, DictConfigWrap, \
    ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score import gsm8k
from verl.workers.rollout.replica import TokenOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_vocab import qwen3_tokenizer  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
PARQUET = FIXTURES / "verl_gsm8k_tool_agent_loop.parquet"
ROWS = FIXTURES / "verl_rows.json"
TENSORS = FIXTURES / "verl_rows.npz"
PROMPT_LENGTH, RESPONSE_LENGTH = 512, 256
LAYERS, TOP_K, EXPERTS = 2, 2, 8
SAMPLES = 2  # rollout.n

RECORDS = [  # gsm8k-shaped: a question, and an answer whose last line is "#### <number>"
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "Betty needs $100 for a wallet. She has half of the money. Her parents give her $15 and her "
                 "grandparents twice as much as her parents. How much more money does Betty need?",
     "answer": "Betty has 100 / 2 = $<<100/2=50>>50.\nHer grandparents give her 15 * 2 = $<<15*2=30>>30.\n"
               "She needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5"},
    {"question": "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write "
                 "a year?",
     "answer": "He writes each friend 3*2 = <<3*2=6>>6 pages a week.\nSo he writes 6*2 = <<6*2=12>>12 pages every "
               "week.\nThat means he writes 12*52 = <<12*52=624>>624 pages a year.\n#### 624"},
]

# What the scripted engine returns for each (prompt, sample): the turns the model "generates".
SCRIPTS = {
    (0, 0): ["<think>\nIn May she sold 48/2 = 24, so 48 + 24 = 72 in all.\n</think>\n\n<tool_call>\n"
             '{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call><|im_end|>',
             "She sold 48 + 24 = 72 clips.\n#### 72<|im_end|>"],
    (0, 1): ["<think>\nMay is half of April: 24. Together 48 + 24 = 70.\n</think>\n\n<tool_call>\n"
             '{"name": "calc_gsm8k_reward", "arguments": {"answer": "70"}}\n</tool_call><|im_end|>',
             "She sold 70 clips.\n#### 70<|im_end|>"],
    (1, 0): ["<think>\n50 minutes is 5/6 of an hour, 12 * 5/6 = 10.\n</think>\n\n<tool_call>\n"
             '{"name": "calc_gsm8k_reward", "arguments": {"answer": "10"}}\n</tool_call><|im_end|>',
             "She earned $10.\n#### 10<|im_end|>"],
    (1, 1): ["<think>\n12 * 50 = 600.\n</think>\n\n<tool_call>\n"
             '{"name": "calc_gsm8k_reward", "arguments": {"answer": "600"}}\n</tool_call><|im_end|>',
             "<think>\nThe tool says no; 50 minutes is under an hour: 12 * 50 / 60 = 10.\n</think>\n\n<tool_call>\n"
             '{"name": "calc_gsm8k_reward", "arguments": {"answer": "10"}}\n</tool_call><|im_end|>',
             "She earned $10.\n#### 10<|im_end|>"],
}


# ----- the parquet, as examples/data_preprocess/gsm8k_tool_agent_loop.py writes it ----------------


def extract_solution(solution_str):
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    assert solution is not None
    final_solution = solution.group(0)
    final_solution = final_solution.split("#### ")[1].replace(",", "")
    return final_solution


def make_map_fn(split, data_source="openai/gsm8k"):
    instruction_following = "Let's think step by step and output the final answer after `####`."

    def process_fn(example, idx):
        question_raw = example.pop("question")

        question = question_raw + " " + instruction_following

        answer_raw = example.pop("answer")
        solution = extract_solution(answer_raw)
        data = {
            "data_source": data_source,
            "agent_name": "tool_agent",
            "prompt": [
                {
                    "role": "system",
                    "content": (
                        "You are a math expert. You are given a question and you need to solve it step by step. "
                        "Reasoning step by step before any tool call. "
                        "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
                        "before generate final answer at least once and refine your answer if necessary. "
                        "Put your final answer in the format of `#### <answer>`."
                    ),
                },
                {
                    "role": "user",
                    "content": question,
                },
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {
                "split": split,
                "index": idx,
                "answer": answer_raw,
                "question": question_raw,
                "need_tools_kwargs": True,
                "tools_kwargs": {
                    "calc_gsm8k_reward": {
                        "create_kwargs": {"ground_truth": solution},
                    },
                },
                "interaction_kwargs": {
                    "query": question,
                    "ground_truth": solution,
                },
            },
        }
        return data

    return process_fn


def write_parquet() -> list[dict]:
    dataset = datasets.Dataset.from_list(RECORDS).map(function=make_map_fn("train"), with_indices=True)
    dataset.to_parquet(str(PARQUET))
    return dataset.to_list()


# ----- the tool loop -----------------------------------------------------------------------------


class Gsm8kTool(BaseTool):
    """verl's gsm8k_tool.py (2066bae) on the 0.9.1 BaseTool interface (create/execute return ToolResponse)."""

    def __init__(self):
        schema = OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {
                "name": "calc_gsm8k_reward",
                "description": "A tool for calculating the reward of gsm8k",
                "parameters": {"type": "object",
                               "properties": {"answer": {"type": "string", "description": "The answer to the question"}},
                               "required": ["answer"]},
            },
        })
        super().__init__({}, schema)
        self._instance_dict = {}

    async def create(self, instance_id=None, create_kwargs=None, **kwargs):
        # 0.9.1's ToolAgentLoop passes the row's tools_kwargs[name]["create_kwargs"] as create_kwargs=...
        instance_id = instance_id or f"gsm8k-{len(self._instance_dict)}"
        ground_truth = (create_kwargs or {}).get("ground_truth")
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        answer = parameters.get("answer", "") if isinstance(parameters, dict) else ""
        answer = answer if isinstance(answer, str) else str(answer)
        self._instance_dict[instance_id]["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id, **kwargs):
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0,
                                   score=1.0)

    async def release(self, instance_id, **kwargs):
        del self._instance_dict[instance_id]


class ScriptedEngine:
    """What verl's LLMServerClient returns from vLLM, scripted: ids, float32 log-probs, a router record, versions."""

    def __init__(self, tokenizer, turns: list[str], first_version: int, seed: int):
        self.tokenizer, self.turns, self.version = tokenizer, list(turns), first_version
        self.rng = np.random.default_rng(seed)
        # The router's choice per position: a later call that re-reads a prefix routes it the same way.
        self.routing = np.random.default_rng(1000 + seed).integers(0, EXPERTS, (4096, LAYERS, TOP_K)).astype(np.int32)

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)
        log_probs = [float(x) for x in (-np.abs(self.rng.normal(0.0, 0.8, len(ids))) - 1e-3).astype(np.float32)]
        routed = self.routing[: len(prompt_ids) + len(ids)].copy()
        version, self.version = self.version, self.version + 1  # the trainer moves on between turns
        return TokenOutput(token_ids=ids, log_probs=log_probs, routed_experts=routed, stop_reason="completed",
                           extra_fields={"min_global_steps": version, "max_global_steps": version})


def rollout_config():
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {
            "prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH, "full_determinism": False,
            "multi_turn": {"max_user_turns": 4, "max_assistant_turns": 4, "max_parallel_calls": 1,
                           "max_tool_response_length": 256, "tool_response_truncate_side": "middle",
                           "format": "hermes"}}},
        "data": {},
    })


def tool_loop_rows(tokenizer, parquet_rows: list[dict]) -> list[AgentLoopOutput]:
    config = rollout_config()
    outputs = []
    for prompt in range(2):
        row = parquet_rows[prompt]
        for sample in range(SAMPLES):  # verl repeats each prompt rollout.n times, interleaved
            engine = ScriptedEngine(tokenizer, SCRIPTS[(prompt, sample)], first_version=3 + prompt, seed=prompt * 10 + sample)
            loop = ToolAgentLoop(trainer_config=DictConfigWrap(config), server_manager=engine, tokenizer=tokenizer,
                                 processor=None, dataset_cls=None, data_config=DictConfigWrap(config.data),
                                 hf_model_type="qwen3", tools=ToolListWrap([Gsm8kTool()]))
            output = loop.loop.run_until_complete(loop.run(
                {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
                raw_prompt=row["prompt"], tools_kwargs=row["extra_info"]["tools_kwargs"],
                extra_info=row["extra_info"]))
            output.reward_score = gsm8k.compute_score(tokenizer.decode(output.response_ids, skip_special_tokens=True),
                                                      row["reward_model"]["ground_truth"])
            outputs.append(output)
    return outputs


def postprocessed_batch(tokenizer, outputs: list[AgentLoopOutput], parquet_rows: list[dict]):
    """verl's AgentLoopWorker padding and batching of the outputs (its own methods, on a worker without Ray)."""
    worker = object.__new__(AgentLoopWorker)
    worker.rollout_config = types.SimpleNamespace(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    worker.tokenizer, worker.processor = tokenizer, None
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.mm_processor_kwargs = None, False, {}
    internal = []
    for index, output in enumerate(outputs):
        raw_prompt = parquet_rows[index // SAMPLES]["prompt"]
        internal.append(asyncio.run(worker._agent_loop_postprocess(copy.deepcopy(output), False, raw_prompt=raw_prompt)))
    return worker._postprocess(internal)


# ----- the video turn ----------------------------------------------------------------------------


def video_row(tokenizer) -> AgentLoopOutput:
    frames = torch.randint(0, 256, (2, 3, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(8)
    mm_inputs = {  # what Qwen2-VL's video processor returns for two 28x28 frames (substituted: see the docstring)
        "pixel_values_videos": torch.randn(4, 3 * 2 * 14 * 14, generator=generator).to(torch.float32),
        "video_grid_thw": torch.tensor([[1, 2, 2]], dtype=torch.int64),
    }
    payload = AgentLoopBase.build_sglang_video_payload([frames], mm_inputs)
    prompt = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What moves in this clip?<|im_end|>\n"
              "<|im_start|>assistant\n")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    response_ids = tokenizer.encode("A red ball rolls to the left.<|im_end|>", add_special_tokens=False)
    rng = np.random.default_rng(9)
    log_probs = [float(x) for x in (-np.abs(rng.normal(0.0, 0.8, len(response_ids))) - 1e-3).astype(np.float32)]
    return AgentLoopOutput(
        prompt_ids=prompt_ids, response_ids=response_ids, response_mask=[1] * len(response_ids),
        response_logprobs=log_probs, multi_modal_data={"videos": [(frames, {"fps": 2.0, "frames_indices": [0, 1]})]},
        mm_processor_kwargs={"fps": 2.0}, mm_processor_output=payload, reward_score=1.0, num_turns=2,
        metrics={"generate_sequences": 0.25, "tool_calls": 0.0},
        extra_fields={"min_global_steps": 7, "max_global_steps": 7},
    )


# ----- writing -----------------------------------------------------------------------------------


def plain(value):
    """A model_dump value as JSON data: tensors and arrays as nested lists, tuples as lists."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def tensors(prefix: str, mapping: dict, out: dict) -> None:
    for key, value in mapping.items():
        if isinstance(value, torch.Tensor):
            out[f"{prefix}_{key}"] = value.numpy()


def main() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen3_tokenizer()
    parquet_rows = write_parquet()
    loops = tool_loop_rows(tokenizer, parquet_rows)
    video = video_row(tokenizer)
    arrays: dict[str, np.ndarray] = {}
    for set_name, outputs in (("tool_loop", loops), ("video", [video])):
        for index, output in enumerate(outputs):
            tensors(f"{set_name}_{index}", copy.deepcopy(output).as_dict(), arrays)
    batch = postprocessed_batch(tokenizer, loops, parquet_rows)
    tensors("batch", dict(batch.batch.items()), arrays)
    meta = {
        "verl": verl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "datasets": datasets.__version__,
        "revision": "verl 0.9.1 from PyPI: the spec's revision 12ebe0cb4d300c58449fb6c675379e8700015c51 is not "
                    "installable here (no network beyond the package registries, and no wheel of that commit)",
        "parquet_layout": "examples/data_preprocess/gsm8k_tool_agent_loop.py at volcengine/verl 030a519 (process_fn "
                          "repeated in this tool), over four synthetic gsm8k-shaped records",
        "tool_loop": "verl ToolAgentLoop.run (hermes format, Qwen3 Continuous Token builder) against a scripted engine, "
                     "with a calc_gsm8k_reward BaseTool after verl/tools/gsm8k_tool.py (2066bae); rows in rollout.n=2 "
                     "order; reward_score from verl.utils.reward_score.gsm8k.compute_score",
        "video": "mm_processor_output from verl AgentLoopBase.build_sglang_video_payload over substituted "
                 "pixel_values_videos/video_grid_thw (Qwen2-VL's video processor needs torchvision, which does not load "
                 "against the CPU torch wheel here)",
        "samples": SAMPLES, "prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH,
        "tokenizer": "tools/qwen3_vocab.py qwen3_tokenizer (Qwen3 vocabulary, tests/fixtures/qwen3_training.jinja)",
    }
    rows = {"meta": meta, "tool_loop": [plain(o.model_dump()) for o in loops], "video": [plain(video.model_dump())]}
    ROWS.write_text(json.dumps(rows, separators=(",", ":")) + "\n")
    np.savez_compressed(TENSORS, **arrays)
    print(f"wrote {PARQUET.name} ({len(parquet_rows)} rows), {ROWS.name} ({len(loops)} tool-loop rows, 1 video row), "
          f"{TENSORS.name} ({len(arrays)} arrays) with verl {verl.__version__}")
    for index, output in enumerate(loops):
        print(f"  tool loop {index}: {len(output.prompt_ids)} prompt ids, {len(output.response_ids)} response ids, "
              f"{sum(output.response_mask)} sampled, reward {output.reward_score}, versions "
              f"{output.extra_fields.get('min_global_steps')}..{output.extra_fields.get('max_global_steps')}")


if __name__ == "__main__":
    main()
