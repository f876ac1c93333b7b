"""The serve command: load the model, start the engine, run the HTTP server until Ctrl-C or
SIGTERM, let the requests in flight finish (up to --shutdown-timeout), exit 0."""

import os
import signal
import sys

import torch
import uvicorn

from data.hf_tokenizer import HFTokenizer
from models.batch_cache import BatchKVCache
from trainer.errors import UsageError
from trainer.formats.registry import model_files_dir
from trainer.host import host_available_gb
from trainer.inference import chat
from trainer.inference.load import load_model, weights_dtype
from trainer.serve.app import Served, build_app
from trainer.serve.batching import BatchedEngine


def serve(args, loaded=None, broadcast=None):
    """loaded: (model, cfg, tokenizer) already loaded, and broadcast: how each engine step
    reaches the other ranks (rank 0 of a sharded serve: trainer/serve/sharded.py)."""
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if loaded is None:
        loaded = load_model(args.path, device, dtype=weights_dtype(args), ema=args.ema)
        check_cache_fits(loaded[0], args)
    model, cfg, tokenizer = loaded
    if tokenizer is None:
        raise UsageError(f"{args.path} has no tokenizer: serve reads and writes text, so it needs the model's own")
    files_dir = model_files_dir(args.path)
    hf = isinstance(tokenizer, HFTokenizer)
    banned = () if hf else (tokenizer.pad,)  # as generate: fairseq's generator never emits <pad>
    engine = BatchedEngine(
        model,
        tokenizer,
        banned,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_len=args.max_positions,
        broadcast=broadcast,
    )
    served = Served(
        engine,
        name=args.model_name or os.path.basename(os.path.normpath(args.path)),
        # As generate: an HF tokenizer starts a text itself (Llama 3's bos); a fairseq LM learned "</s> text".
        start_ids=[] if hf else [tokenizer.eos],
        stop_ids=chat.stop_ids(tokenizer, files_dir, cfg),
        chat=_chat_template(files_dir, tokenizer) if hf else None,
        api_key=args.api_key,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
    )
    config = uvicorn.Config(
        build_app(served),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.shutdown_timeout,
        log_level="info",
    )
    server = uvicorn.Server(config)
    # uvicorn handles SIGINT/SIGTERM while it runs (stop accepting, drain, then cancel what is
    # left), then raises the signal again under the handlers found before it: these make that
    # second delivery a no-op, so a requested shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    where = f"http://{args.host}:{args.port}/v1 ({device}, {served.dtype}, {engine.max_positions} positions)"
    print(f"serve: {served.name} on {where}", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        engine.close()
    if not server.started:  # uvicorn said why (the port is taken, say)
        return 1
    return 0


def check_cache_fits(model, args, ranks_here=1, heads_share=1):
    """Refuse, before allocating it, a KV cache this device cannot hold: it is --max-batch rows
    of every position, and a long-context model's positions (Llama 3's 131072) make that far
    more than its weights. ranks_here: the ranks on this host, which share a CPU's memory;
    heads_share: the ranks the heads are split over (tensor parallelism), each caching its own."""
    positions = min(args.max_positions or model.max_positions, model.max_positions)
    need = BatchKVCache.bytes_needed(model, args.max_batch, positions) / heads_share / 2**30
    device = next(model.parameters()).device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] / 2**30
    else:
        free = host_available_gb()
        free = None if free is None else free / ranks_here
    if free is not None and need > 0.9 * free:
        raise UsageError(
            f"the KV cache of --max-batch {args.max_batch} rows x {positions} positions needs {need:.1f} GB and "
            f"{device.type} has {free:.1f} GB free: lower --max-positions (or --max-batch)"
        )


def _chat_template(files_dir, tokenizer):
    """(template, specials, end-of-turn id), or None for a model without a chat template."""
    try:
        template = chat.chat_template(files_dir)
    except UsageError:
        return None
    specials = chat.special_tokens(files_dir)
    return template, specials, chat.end_of_turn_id(template, specials, tokenizer)
