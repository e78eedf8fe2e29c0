"""Fine-tune a Hugging Face ``transformers`` causal LM in FP8 with fp8engine.

    python examples/hf_finetune.py --model llama-tiny --steps 50                    # CPU, seconds
    python examples/hf_finetune.py --model llama-1b --device cuda --precision fp8 --steps 60
    python examples/hf_finetune.py --model-path /path/to/local/checkpoint --data my.txt --device cuda

The model is built from a config (random init; nothing is downloaded) or loaded from a local directory
(``--model-path``, ``local_files_only``). ``fp8engine.convert_to_fp8`` swaps its linear layers (the LM head and
layers whose dims are not multiples of 16 stay in high precision; the report is printed). Data: ``--data`` (a
text file), else the bundled ``../shared/data/tinyshakespeare.txt`` next to the repository, else a short built-in
text; tokens are the text's bytes (vocabulary 256), or the checkpoint's tokenizer with ``--model-path`` when it has
one. Parameters stay fp32 (AdamW master weights); ``--precision bf16`` runs under ``torch.autocast(bfloat16)``,
``fp8`` adds ``fp8engine.autocast`` (delayed scaling) on top (on CPU: fp32 + FP8). On CUDA the step is captured in
a CUDA graph (``fp8engine.training.step.CUDAGraphStep``, static shapes) and replayed; if the capture fails the run
says so in one line and continues eagerly. Progress: a tqdm bar (loss, tokens/s); with ``--out``, one JSON line per
step in ``metrics.jsonl`` (``step``, ``loss``, ``lr``, ``tokens_per_s``) as in ``fp8engine.train``. The last line
is the median tokens/s over the steps after the first quarter (warm-up and capture excluded).

Loss (``--lm-loss``): by default the LM head and the cross-entropy are fused and chunked
(:func:`fp8engine.ops.lm_head.lm_head_cross_entropy`: the ``[tokens, vocab]`` logits are never materialized) for the
architectures whose logits are exactly ``last_hidden_state @ lm_head.weight.T`` (:data:`FUSED_LOSS_MODEL_TYPES`, no
head bias); ``liger`` / ``cce`` use those libraries (CUDA), ``unfused`` the model's logits. Other architectures
(logit scaling or soft-capping) run unfused, and the run says so in one line.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

from fp8engine._cli import CommandParser, usage_error
from fp8engine._cpu import flush_denormals, prefer_avx2_cpu_kernels

PROG = "examples/hf_finetune.py"
REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
FALLBACK_TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
                 "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n") * 64

# name -> (family, config kwargs, default batch size, default seq len). Random init from these configs.
PRESETS = {
    "llama-tiny": ("llama", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256), 4, 64),
    "gpt2-tiny": ("gpt2", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256), 4, 64),
    # GPT-2 small (124M), OpenAI's config.
    "gpt2-124m": ("gpt2", dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024), 16, 1024),
    # Llama 3.2 1B's shapes (tied embeddings, GQA 32/8).
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                               rope_theta=500000.0, tie_word_embeddings=True), 8, 1024),
}


#: ``config.model_type`` of the architectures whose logits are ``base_model(x).last_hidden_state @ lm_head.weight.T``
#: (no logit scale, soft-cap or bias), where the fused LM head + loss gives the model's own loss.
FUSED_LOSS_MODEL_TYPES = ("llama", "gpt2", "mistral", "qwen2")
LM_LOSSES = ("chunked", "liger", "cce", "unfused")


def build_parser() -> CommandParser:
    p = CommandParser(prog=PROG, description=__doc__)
    p.add_argument("--model", default="llama-tiny", choices=list(PRESETS), help="random-init preset")
    p.add_argument("--model-path", help="local transformers checkpoint directory (overrides --model)")
    p.add_argument("--data", help="text file to fine-tune on (default: bundled tinyshakespeare, else built-in)")
    p.add_argument("--precision", default="fp8", choices=("fp8", "bf16"))
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--batch-size", type=int, help="sequences per step (default per preset)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default per preset)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate (cosine decay)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run the step eagerly")
    p.add_argument("--lm-loss", default="chunked", choices=LM_LOSSES,
                   help="LM head + cross-entropy: fused and chunked (plain PyTorch), liger-kernel's or cut-cross-"
                        "entropy's fused loss (CUDA), or unfused (the model's logits)")
    p.add_argument("--out", help="directory for metrics.jsonl")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            usage_error(PROG, f"--{name.replace('_', '-')} must be >= 1; got {value}")
    if args.lr <= 0:
        usage_error(PROG, f"--lr must be > 0; got {args.lr}")
    if args.data is not None and not Path(args.data).is_file():
        usage_error(PROG, f"--data {args.data}: no such file")
    if args.model_path is not None and not Path(args.model_path).is_dir():
        usage_error(PROG, f"--model-path {args.model_path}: no such directory")
    return args


def build_model(args, torch, transformers):
    """The model (fp32, on the device) and a ``(encode, vocab_size)`` pair."""
    if args.model_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True,
                                                                  torch_dtype=torch.float32)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
            encode = tok.encode
        except (OSError, ValueError):
            encode = None
        batch, seq = 8, 512
    else:
        family, kwargs, batch, seq = PRESETS[args.model]
        torch.manual_seed(args.seed)
        if family == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
        else:
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs))
        encode = None
    vocab = model.get_input_embeddings().num_embeddings
    if encode is None:
        if vocab < 256:
            usage_error(PROG, f"the model's vocabulary ({vocab}) is smaller than the 256 byte tokens")
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
    args.batch_size = args.batch_size or batch
    args.seq_len = args.seq_len or seq
    return model, encode


def load_tokens(args, encode, torch):
    if args.data:
        text, source = Path(args.data).read_text(encoding="utf-8", errors="replace"), args.data
    elif BUNDLED.is_file():
        text, source = BUNDLED.read_text(encoding="utf-8"), str(BUNDLED)
    else:
        text, source = FALLBACK_TEXT, "the built-in fallback text (bundled tinyshakespeare not found)"
    tokens = torch.tensor(encode(text), dtype=torch.long)
    if tokens.numel() <= args.seq_len + 1:
        usage_error(PROG, f"the text has {tokens.numel()} tokens, not enough for --seq-len {args.seq_len}")
    print(f"data: {source}, {tokens.numel():,} tokens", flush=True)
    return tokens


class CausalLMLoss:
    """``step_model(x, y, is_first_microbatch=None) -> mean cross entropy`` for a transformers causal LM, as
    :class:`fp8engine.training.step.TrainStep` calls it (``y``: the next-token targets). ``lm_loss``: a backend of
    :func:`fp8engine.ops.lm_head.lm_head_cross_entropy` over the base model's last hidden state and the LM head's
    weight, or ``"unfused"`` (the model's logits, then ``cross_entropy``)."""

    def __init__(self, model, torch, lm_loss: str = "unfused"):
        self.model, self.torch, self.lm_loss = model, torch, lm_loss

    def __call__(self, x, y, is_first_microbatch=None):
        if self.lm_loss == "unfused":
            logits = self.model(input_ids=x, use_cache=False).logits
            return self.torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        from fp8engine.ops.lm_head import lm_head_cross_entropy

        hidden = self.model.base_model(input_ids=x, use_cache=False).last_hidden_state
        return lm_head_cross_entropy(hidden, self.model.get_output_embeddings().weight, y, self.lm_loss)


def lm_loss_for(model, requested: str) -> tuple[str, str]:
    """``(backend, note)``: ``requested``, or ``"unfused"`` where the model's logits are not a plain head GEMM of
    its last hidden state (``note`` then says why, for one printed line; else empty)."""
    head = model.get_output_embeddings()
    plain = (model.config.model_type in FUSED_LOSS_MODEL_TYPES and head is not None
             and getattr(head, "bias", None) is None)
    if requested == "unfused" or plain:
        return requested, ""
    return "unfused", (f"--lm-loss {requested}: {model.config.model_type} models are not known to have plain "
                       "head logits (no scale, soft-cap or bias); using the unfused loss")


def main(argv=None) -> int:
    prefer_avx2_cpu_kernels()  # before the first CPU kernel (fp8engine/_cpu.py)
    args = parse_args(argv)
    with flush_denormals():  # CPU denormals read as 0 (FP8ENGINE_FLUSH_DENORMAL=0: kept; fp8engine/_cpu.py)
        return finetune(args)


def finetune(args) -> int:
    """The run of :func:`main` on parsed ``args``."""
    import torch
    import transformers

    import fp8engine as fe
    from fp8engine.train import lr_at
    from fp8engine.training.metrics import MetricsLog
    from fp8engine.training.step import CUDAGraphStep, TrainStep, capture_problem, make_optimizer, set_lr
    from tqdm.auto import tqdm

    if args.device == "cuda" and not torch.cuda.is_available():
        usage_error(PROG, "--device cuda: no CUDA device here")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    transformers.logging.set_verbosity_error()
    model, encode = build_model(args, torch, transformers)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model_path or args.model}, {n_params / 1e6:.1f}M parameters, {args.precision} on {device}, "
          f"batch {args.batch_size} x {args.seq_len}, lm loss {args.lm_loss}", flush=True)
    if args.precision == "fp8":
        print(fe.convert_to_fp8(model), flush=True)
    tokens = load_tokens(args, encode, torch)

    def context():
        stack = contextlib.ExitStack()
        if args.precision == "bf16" or device.type == "cuda":
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        if args.precision == "fp8":
            stack.enter_context(fe.autocast())
        return stack

    def clip(params):
        return torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=device.type == "cuda")

    optimizer = make_optimizer(model, args.lr, 0.1, device)
    lm_loss, note = lm_loss_for(model, args.lm_loss)
    if note:
        print(note, flush=True)
    step_model, params = CausalLMLoss(model, torch, lm_loss), list(model.parameters())
    problem = capture_problem(device, False)
    if args.cuda_graphs and problem is None:
        step_fn = CUDAGraphStep(step_model, params, optimizer, context, 1, clip, device=device)
    else:
        step_fn = TrainStep(step_model, params, optimizer, context, 1, clip, device=device)
    gen = torch.Generator().manual_seed(args.seed)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    log = MetricsLog(Path(args.out) if args.out else None)
    tokens_per_step = args.batch_size * args.seq_len
    rates = []
    bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    try:
        for step in range(1, args.steps + 1):
            starts = torch.randint(0, tokens.numel() - args.seq_len - 1, (args.batch_size,), generator=gen)
            chunk = torch.stack([tokens[s:s + args.seq_len + 1] for s in starts.tolist()])
            xs, ys = chunk[None, :, :-1], chunk[None, :, 1:]  # [grad_accum=1, b, s]
            lr = lr_at(step, args.lr, max(1, args.steps // 10), args.steps)
            t0 = time.perf_counter()
            set_lr(optimizer, lr)
            try:
                loss = step_fn(xs, ys).item()
            except RuntimeError as err:
                if not isinstance(step_fn, CUDAGraphStep) or step_fn.captured:
                    raise
                bar.write(f"CUDA graphs: capture failed ({str(err).splitlines()[0][:120]}); running eagerly")
                torch.cuda.synchronize(device)
                optimizer.zero_grad(set_to_none=True)
                step_fn = TrainStep(step_model, params, optimizer, context, 1, clip, device=device)
                loss = step_fn(xs, ys).item()
            record = {"step": step, "loss": loss, "lr": lr,
                      "tokens_per_s": tokens_per_step / (time.perf_counter() - t0)}
            rates.append(record["tokens_per_s"])
            log.log(record)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
            bar.update(1)
    finally:
        bar.close()
        log.close()
    graphs = "CUDA graph" if isinstance(step_fn, CUDAGraphStep) and step_fn.captured else "eager"
    timed = rates[args.steps // 4:] or rates
    print(f"final loss {loss:.4f}; median tokens/s {statistics.median(timed):,.0f} "
          f"(steps {args.steps - len(timed) + 1}-{args.steps}, {args.precision}, {graphs}, {device})", flush=True)
    if args.out:
        print(f"wrote {Path(args.out) / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
