"""generate (fairseq-interactive): text continuations sampled from a trained model or a
Hugging Face model directory (--temperature 0: greedy, transformers' do_sample=False).
With --chat, replies of a chat model to conversations, through its chat template."""

import sys

import torch

from data.data_dir import data_dirs
from data.hf_tokenizer import HFTokenizer
from data.tokenizer import load_tokenizer
from models.generate import sample
from trainer.errors import UsageError
from trainer.formats.fairseq.checkpoint_file import check_fairseq_dictionary, is_fairseq_checkpoint
from trainer.formats.registry import model_files_dir
from trainer.inference import chat
from trainer.inference.load import load_model
from trainer.parallel.ranks import init_rank, teardown


def read_prompts(args):
    """--prompt's, else one per line of stdin (read before the model is loaded, so an empty
    stdin is refused first)."""
    prompts = args.prompt if args.prompt else [line.rstrip("\n") for line in sys.stdin]
    if not prompts:
        raise UsageError("no prompts: pass --prompt TEXT, or one prompt per line on stdin")
    return prompts


def generate(args, prompts=None, env=None):
    """Print the continuation of each prompt (--prompt, else one per line of stdin), or with
    --chat the assistant's reply to each conversation. env: a rank of a model split over
    ranks (--model-parallel-size, `run`): every rank samples the same tokens from the same
    gathered logits and seed, and rank 0 prints them."""
    chatting = getattr(args, "chat", False)
    _check_chat_flags(args, chatting)
    # A chat from stdin is read turn by turn, after the model is loaded, as its user types.
    conversations = _conversations(args) if chatting else None
    prompts = None if chatting else prompts or read_prompts(args)
    # On a GPU when there is one, as eval-lm and serve: sampling is a forward per token.
    device = env.device if env is not None else "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model, cfg, tokenizer = load_model(args.path, device, ema=args.ema, env=env)
    files_dir = model_files_dir(args.path)
    if getattr(args, "data", None):
        tokenizer = _data_tokenizer(args.data, args.path, tokenizer, model.vocab_size)
        files_dir = data_dirs(args.data)[0]
    if tokenizer is None:
        if is_fairseq_checkpoint(args.path):
            raise UsageError(
                f"{args.path} is a fairseq checkpoint, which holds no dictionary: pass the data-bin it was "
                f"trained on (generate DATA --path {args.path}), or put its dict.txt beside it"
            )
        raise UsageError(
            f"{args.path} has no tokenizer (trained with --task dummy_lm?): nothing can turn text into its tokens"
        )
    stop = chat.stop_ids(tokenizer, files_dir, cfg)
    if chatting:
        return _chat(args, model, tokenizer, files_dir, stop, conversations, env)
    # A Hugging Face tokenizer starts a text as its model learned texts start (Llama 3's
    # <|begin_of_text|>; nothing for Qwen3); a fairseq LM learned every block as "</s> sentence".
    start = [] if isinstance(tokenizer, HFTokenizer) else [tokenizer.eos]
    for i, prompt in enumerate(prompts):
        ids = start + tokenizer.encode(prompt)
        new = _sample(args, model, tokenizer, ids, stop, seed=args.seed + i)
        if env is None or env.is_master:  # decoded whole: a piece's leading space belongs to the text around it
            print(tokenizer.decode(ids[len(start) :] + new), flush=True)
    return 0


def run(args, prompts, cfg, rdv):
    """One rank of generate --model-parallel-size N (launched like eval-lm)."""
    env = init_rank(cfg, rdv, needs_process_group=True)
    try:
        return generate(args, prompts, env)
    finally:
        teardown()


def _sample(args, model, tokenizer, ids, stop, seed):
    try:
        return sample(
            model,
            ids,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=seed,
            eos=stop,
            bos=tokenizer.eos if tokenizer.bos is None else tokenizer.bos,
            use_cache=not args.no_kv_cache,
            # fairseq's sequence generator never emits <pad>; an HF tokenizer's pad is often its eos
            banned=() if isinstance(tokenizer, HFTokenizer) else (tokenizer.pad,),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_chat_flags(args, chatting):
    system, messages = getattr(args, "system", None), getattr(args, "messages", None)
    if not chatting and (system is not None or messages):
        raise UsageError("--system and --messages are parts of a conversation: add --chat")
    if messages and (args.prompt or system is not None):
        raise UsageError(
            "--messages FILE holds whole conversations: put their user and system turns there, not in --prompt/--system"
        )


def _conversations(args):
    """The conversations to reply to, or None: read user turns from stdin, one a line."""
    system = [{"role": "system", "content": args.system}] if getattr(args, "system", None) is not None else []
    if getattr(args, "messages", None):
        return chat.read_conversations(args.messages)
    if args.prompt:
        return [system + [{"role": "user", "content": p}] for p in args.prompt]
    return None


def _chat(args, model, tokenizer, files_dir, stop, conversations, env=None):
    if not isinstance(tokenizer, HFTokenizer):
        raise UsageError(
            f"{files_dir}'s tokenizer is not a Hugging Face one, so it has no chat template: --chat needs a chat "
            "model (or data made by preprocess --tokenizer CHAT_MODEL_DIR)"
        )
    template, specials = chat.chat_template(files_dir), chat.special_tokens(files_dir)
    end_of_turn = chat.end_of_turn_id(template, specials, tokenizer)
    stop = stop + ([end_of_turn] if end_of_turn is not None and end_of_turn not in stop else [])

    def reply(messages, seed):
        ids = tokenizer.encode_rendered(chat.render_chat(template, messages, True, specials))
        return tokenizer.decode_without_specials(_sample(args, model, tokenizer, ids, stop, seed))

    if conversations is not None:
        for i, messages in enumerate(conversations):
            answer = reply(messages, args.seed + i)  # on every rank of a split model: each forward is the group's
            if env is None or env.is_master:
                print(answer, flush=True)
        return 0
    # Interactive: one conversation, each stdin line a user turn, each reply kept in it.
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    turns = 0
    for turns, line in enumerate(_stdin_lines(), 1):
        messages.append({"role": "user", "content": line})
        answer = reply(messages, args.seed + turns - 1)
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
    if not turns:
        raise UsageError("no user turns: pass --prompt TEXT or --messages FILE, or type one turn per line on stdin")
    return 0


def _stdin_lines():
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line.rstrip("\n")


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
