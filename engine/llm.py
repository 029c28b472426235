"""`LLM`: the offline, batch API (vLLM-compatible surface)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.outputs import EmbeddingRequestOutput, RequestOutput, SchedulerStats
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.processor import PromptType
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.tool_parsers.tool_spec import messages_for_template, parse_tools, tools_for_template

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate text for batches of prompts with continuous batching over a paged KV cache.

    Keyword arguments are `EngineConfig` fields (block_size, max_num_seqs, max_num_batched_tokens,
    max_model_len, enable_prefix_caching, enable_chunked_prefill, kv_cache_memory, seed,
    scheduling_policy, tensor_parallel_size, pipeline_parallel_size, ...).
    """

    def __init__(self, model: str, *, dtype: str = "auto", **kwargs: Any) -> None:
        config = EngineConfig(model=model, dtype=dtype, **kwargs)
        self.llm_engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        `lora_request` (with enable_lora): the adapter every prompt runs under, or one per prompt (None:
        the base model); prompts of different adapters and of the base model share batches.

        Bad input raises ValueError (naming the field) before anything runs. A request that fails
        while running (e.g. in its logits processing, or with its batch's forward pass) does not
        raise: its output has finish_reason "error" and `RequestOutput.error` says why, and the
        other prompts' outputs are unaffected.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts; give one or one per prompt"
                )
        return self._add_and_run(prompts, params_list, priority, use_tqdm, lora_request)  # type: ignore[return-value]

    def _add_and_run(self, prompts: list[PromptType], params_list: list[SamplingParams | PoolingParams],
                     priority: Sequence[int] | None, use_tqdm: bool,
                     lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                     ) -> list[RequestOutput | EmbeddingRequestOutput]:
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts; give one or one per prompt")

        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params, priority=priority[i] if priority is not None else 0,
                                   lora_request=loras[i])
                request_ids.append(request_id)
        except BaseException:
            engine.abort_request(request_ids)  # a bad prompt must not leave its batch-mates running
            raise
        return self._run_engine(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`, a list of floats), in the order of the prompts:
        the served decoder's final-norm hidden states pooled as `pooling_params` say (default: the engine's
        `pooling` and `normalize_embeddings`). Each prompt is a prefill-only request in the same continuous
        batch as any generation. Bad input raises ValueError; a request that fails while running does not
        raise: its output's `error` says why (its embedding is empty)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        if isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"pooling_params: got {len(params_list)} for {len(prompts)} prompts; give one or one per prompt"
                )
        return self._add_and_run(prompts, params_list, priority, use_tqdm)  # type: ignore[return-value]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template and generate a reply to each.

        `tools`: OpenAI function tools, rendered by the chat template as the model was trained; read the
        calls out of each output with a parser (`pagedserve.engine.tool_parsers.get_tool_parser`), or force
        one with structured output (`tool_spec.forced_call_schema`)."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
        prompts = [
            {"prompt_token_ids": self.render_chat(conv, chat_template, add_generation_prompt, continue_final_message,
                                                  tools)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(
        self,
        conversation: ChatMessages,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat_template: the tokenizer has no chat template; pass chat_template=")
        template_tools = tools_for_template(parse_tools(tools)) if tools else None
        ids = tokenizer.apply_chat_template(
            messages_for_template(conversation),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=True,
            tools=template_tools,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput | EmbeddingRequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(finished) < len(request_ids):
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
            # What a KV connector still owes rides on one more step (a prefill producer's hold grants to its
            # ranks in other processes, a consumer's releases): deliver it before the outputs go out.
            while engine.get_num_unfinished_requests() == 0 and engine.has_unfinished_requests():
                engine.step()
        except BaseException:
            engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]

    def get_stats(self) -> SchedulerStats:
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
