"""The engine's commands: `minivllm generate | convert | replay` (`serve` is added by server.cli)."""

import argparse
import logging
import sys

from minivllm.models import backend as _backend  # noqa: F401  (OpenBLAS before mlx)


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="minivllm generate", description="Stream a completion for one prompt.")
    p.add_argument(
        "--model", default=None, help="model dir, .gguf file or repo id (default: the offline default model)"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    args = p.parse_args(argv)

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.sampling_params import SamplingParams
    from minivllm.outputs import FinishReason

    try:
        params = SamplingParams(args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed)
        engine = LLMEngine(EngineConfig(model=args.model))
        tok = engine.tokenizer
        if args.no_chat_template or not tok.chat_template:
            prompt = tok.encode(args.prompt)
        else:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True
            )
        engine.add_request("cli", prompt, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    decode, error = tok.decode_stream(), None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = "".join(decode(t) or "" for t in out.new_token_ids if t not in engine.eos_token_ids)
            print(text, end="", flush=True)
            if out.finish_reason == FinishReason.ERROR:  # a fault: never a silently short completion
                error = out.error
    print(flush=True)
    if error is not None:
        print(f"error: the request failed: {error}", file=sys.stderr)
        return 1
    return 0


def convert_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="minivllm convert",
        description="Convert a GGUF file into an MLX model directory. By default the GGUF's quantization is "
        "carried over (Q8_0/Q5_0/Q4_K/... blocks become MLX affine weights of the same values, per-module "
        "widths); --bits re-quantizes every matrix to one width instead.",
    )
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.add_argument(
        "--bits", type=int, choices=(2, 3, 4, 5, 6, 8), help="re-quantize uniformly to this width (affine)"
    )
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), help="with --bits (default 64)")
    p.add_argument(
        "--scale-dtype",
        choices=("float16", "float32"),
        help="with --bits: scales and biases (default float16)",
    )
    args = p.parse_args(argv)
    from minivllm.models.gguf_import import GGUFError, UniformQuantization, convert_gguf

    if args.bits is None and (args.group_size or args.scale_dtype):
        p.error("--group-size and --scale-dtype apply to uniform re-quantization: add --bits")
    uniform = None
    if args.bits is not None:
        uniform = UniformQuantization(args.bits, args.group_size or 64, args.scale_dtype or "float16")
    try:
        out = convert_gguf(args.gguf, args.out_dir, uniform=uniform)
    except (GGUFError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def replay_main(argv: list[str]) -> int:
    from minivllm.replay import main

    return main(argv)


COMMANDS = {"generate": generate_main, "convert": convert_main, "replay": replay_main}


def main(argv: list[str] | None = None, commands: dict = COMMANDS) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in commands:
        print(f"usage: minivllm {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
