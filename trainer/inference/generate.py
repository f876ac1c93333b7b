"""generate (fairseq-interactive): text continuations sampled from a trained model or a
Hugging Face model directory (--temperature 0: greedy, transformers' do_sample=False)."""

import sys

from data.data_dir import data_dirs
from data.hf_tokenizer import HFTokenizer
from data.tokenizer import load_tokenizer
from models.generate import sample
from trainer.config.fairseq_model import check_fairseq_dictionary, is_fairseq_checkpoint
from trainer.errors import UsageError
from trainer.inference.load import load_model


def generate(args):
    """Print the continuation of each prompt (--prompt, else one per line of stdin)."""
    # Prompts first: an empty stdin is refused before the model is loaded.
    prompts = args.prompt if args.prompt else [line.rstrip("\n") for line in sys.stdin]
    if not prompts:
        raise UsageError("no prompts: pass --prompt TEXT, or one prompt per line on stdin")
    model, _, tokenizer = load_model(args.path)
    if getattr(args, "data", None):
        tokenizer = _data_tokenizer(args.data, args.path, tokenizer, model.vocab_size)
    if tokenizer is None:
        if is_fairseq_checkpoint(args.path):
            raise UsageError(
                f"{args.path} is a fairseq checkpoint, which holds no dictionary: pass the data-bin it was "
                f"trained on (generate DATA --path {args.path}), or put its dict.txt beside it"
            )
        raise UsageError(
            f"{args.path} has no tokenizer (trained with --task dummy_lm?): nothing can turn text into its tokens"
        )
    # A Hugging Face tokenizer starts a text as its model learned texts start (Llama 3's
    # <|begin_of_text|>; nothing for Qwen3); a fairseq LM learned every block as "</s> sentence".
    start = [] if isinstance(tokenizer, HFTokenizer) else [tokenizer.eos]
    for i, prompt in enumerate(prompts):
        ids = start + tokenizer.encode(prompt)
        try:
            new = sample(
                model,
                ids,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed + i,
                eos=tokenizer.eos,
                bos=tokenizer.eos if tokenizer.bos is None else tokenizer.bos,
                use_cache=not args.no_kv_cache,
                # fairseq's sequence generator never emits <pad>; an HF tokenizer's pad is often its eos
                banned=() if isinstance(tokenizer, HFTokenizer) else (tokenizer.pad,),
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        # Decoded whole: a piece's leading space belongs to the text around it.
        print(tokenizer.decode(ids[len(start) :] + new), flush=True)
    return 0


def _data_tokenizer(data, path, model_tokenizer, vocab_size):
    """DATA's tokenizer, which must be the model's own when it has one, and fit its embedding."""
    data_dir = data_dirs(data)[0]
    tokenizer = load_tokenizer(data_dir)
    if model_tokenizer is not None and model_tokenizer.pieces() != tokenizer.pieces():
        raise UsageError(f"{data_dir}'s tokenizer is not the model's own; drop DATA or pass the model's data")
    if is_fairseq_checkpoint(path):
        check_fairseq_dictionary(path, data_dir, tokenizer.vocab_size)
    elif tokenizer.vocab_size > vocab_size:
        raise UsageError(f"{data_dir} has a vocabulary of {tokenizer.vocab_size}, the model {vocab_size}")
    return tokenizer
