"""Compose the run's config from the three ways of setting it.

Precedence, lowest first: the experiment file (--config-dir/--config-name), then the
--arch preset, then flags, then dotted overrides. Each of the three sources is a layer
of (dotted key, value) settings; inside a layer a group selection (`model=NAME`,
`--arch NAME`, `optimizer: adamw` in a file) is applied before the layer's other keys,
so `--arch X --decoder-layers 4` gives X with 4 layers, as fairseq's arch functions do.
A selection sets only the keys its option names (fairseq's getattr-default semantics).

fairseq-hydra-train's files load as they are: group options by path
(`model=transformer_lm/transformer_lm_gpt`, conf/model/transformer_lm/ holds fairseq's),
defaults lists with `_self_` and null entries, `# @package _group_` headers, fairseq's
key aliases (KEY_ALIASES), one-element lists (`lr: [0.25]`), and fairseq's config.yaml
with its `hydra.run.dir: .` and groups train has no use for (ABSENT_GROUPS) at null.
"""

import difflib
import re
import typing
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config.flags import _base_type, iter_fields, parse_float_list
from trainer.config.implied import resolve_implied
from trainer.config.schema import GROUP_OPTIONS, GROUPS, register_configs
from trainer.errors import UsageError
from trainer.formats.hf.config import CONFIG as HF_CONFIG
from trainer.formats.hf.config import hf_model_settings, is_hf_dir

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
FIELD_TYPES = {f"{g}.{f.name}": f.type for g, f in iter_fields()}


def compose_config(flag_settings, overrides, config_dir=None, config_name=None) -> DictConfig:
    cfg = base_config()
    layers = []
    if config_dir and not config_name and (Path(config_dir) / "config.yaml").is_file():
        # fairseq-hydra-train's primary config is `config` of the search path: DIR's own
        # config.yaml, else the bundled one (shardlm's conf/config.yaml, i.e. base_config),
        # with DIR searched for group options either way.
        config_name = "config"
    if config_name:
        path = Path(config_dir or ".") / f"{config_name}.yaml"
        layers += [(str(path), settings) for settings in file_settings(config_dir, config_name)]
    layers.append(("flag", list(flag_settings)))
    layers.append(("override", override_settings(overrides)))
    given = set()  # the keys the user set, in any of the three ways
    for source, settings in layers:
        settings = resolve_aliases(settings, source)
        given.update(key for key, _ in settings)
        selections = [s for s in settings if _is_selection(s[0])]
        for key, value in selections + [s for s in settings if not _is_selection(s[0])]:
            apply_setting(cfg, key, value, source, config_dir)
    return resolve_implied(cfg, given)


def base_config() -> DictConfig:
    """conf/config.yaml composed by Hydra: the schema plus each group's default option."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():  # a job of `train -m`: Hydra already searches conf/
        cfg = compose(config_name="config")
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config")
    OmegaConf.set_struct(cfg, True)
    return cfg


def _is_selection(key):
    group, _, name = key.partition(".")
    return group in GROUP_OPTIONS and name == "_name"


# fairseq's other names of shardlm keys: one table for YAML files, group option files and
# dotted overrides (flags take theirs from the schema's `alias`: --relu-dropout, --max-sentences).
KEY_ALIASES = {
    "model.relu_dropout": "model.activation_dropout",  # fairseq's old name; its model files set both
    "task.max_target_positions": "model.max_target_positions",  # fairseq has one per group; one limit here
    "dataset.max_sentences": "dataset.batch_size",  # fairseq's old name
}

# fairseq's config groups that `train` has no use for. fairseq's own config.yaml selects
# each as null, which is accepted (nothing selected, nothing to do); a value is refused.
ABSENT_GROUPS = {
    "bpe": "BPE is a preprocessing choice in shardlm: `preprocess` encodes the text before training",
    "tokenizer": "tokenizing is a preprocessing choice in shardlm: `preprocess` encodes the text before training",
    "scoring": "train scores nothing but its loss (see eval-lm for perplexity)",
    "generation": "train generates nothing; generation options are flags of `generate`",
    "common_eval": "evaluation options are flags of `eval-lm` and `generate`",
    "eval_lm": "perplexity evaluation is the `eval-lm` command, with its own flags",
}

# fairseq's lists of one value per epoch (fairseq's --lr and --update-freq take several).
PER_EPOCH_LISTS = {
    "optimization.lr": "fairseq's per-epoch lr lists are not supported; give one value (lr: [0.25]) and an "
    "--lr-scheduler for an lr that changes",
    "optimization.update_freq": "fairseq's per-epoch update_freq lists are not supported; give one value "
    "(update_freq: [4])",
}


def resolve_aliases(settings, source):
    """Settings with fairseq's alias keys renamed to shardlm's. An alias and its key both
    set by one source must agree: which one was meant is not for us to guess."""
    given = dict(settings)
    for alias, key in KEY_ALIASES.items():
        if (
            alias in given
            and key in given
            and _normalize(key, given[alias], source) != _normalize(key, given[key], source)
        ):
            raise UsageError(
                f"{source}: {alias}={given[alias]!r} and {key}={given[key]!r} differ, and "
                f"{alias.split('.')[1]} is fairseq's name of {key}; set only one of them"
            )
    return [(KEY_ALIASES.get(k, k), v) for k, v in settings]


def apply_setting(cfg, key, value, source, config_dir=None):
    group = key.split(".")[0]
    if group == "hydra" or group.startswith("hydra/"):
        return check_hydra_setting(key, value, source)
    if group in ABSENT_GROUPS:
        if value is None:  # fairseq's `- bpe: null`: nothing selected, nothing to do
            return
        shown = f"{group}={value}" if key in (group, f"{group}._name") else f"{key}={value!r}"
        raise UsageError(
            f"{source}: {shown} is not a train setting: {ABSENT_GROUPS[group]}; drop it (or set {group} to null)"
        )
    if key not in FIELD_TYPES:
        raise UsageError(f"{source}: {unknown_key_message(key)}")
    value = _normalize(key, value, source)
    if _is_selection(key):
        if value is None:
            raise UsageError(
                f"{source}: {group}=null selects no {group}, and train always has one; "
                f"name an option (e.g. {group}={GROUPS[group]()._name}) or leave it out"
            )
        value, option_settings, option_source = group_option(group, value, config_dir)
        option_source = option_source or source
        for k, v in resolve_aliases(option_settings, option_source):
            apply_setting(cfg, k, v, option_source, config_dir)
    _set(cfg, key, value, source)


def check_hydra_setting(key, value, source):
    """fairseq's config.yaml sets `hydra.run.dir: .` (run in the working directory): what
    train always does, so it is accepted. A single run would ignore any other Hydra
    setting, so those are refused."""
    if key == "hydra.run.dir" and value == ".":
        return
    if key == "hydra.run.dir":
        raise UsageError(
            f"{source}: hydra.run.dir={value!r}: train runs in the working directory (only "
            "`hydra.run.dir: .` is accepted); set checkpoint.save_dir for where it writes"
        )
    raise UsageError(
        f"{source}: {key} is a Hydra setting that a single train run does not take (only "
        "`hydra.run.dir: .`); Hydra's sweeps and launchers run with `train -m`, e.g. "
        "hydra/launcher=slurm"
    )


def _set(cfg, key, value, source):
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except OmegaConfBaseException as e:
        reason = str(e).splitlines()[0]
        raise UsageError(f"{source}: cannot set {key}={value!r}: {reason}") from None


def _normalize(key, value, source="override"):
    """Accept fairseq's spellings: `lr: [0.0005]` for a scalar, "(0.9,0.98)" for a list."""
    tp = _base_type(FIELD_TYPES[key])[0]
    is_list = typing.get_origin(tp) in (list, typing.List)
    if (
        is_list and typing.get_args(tp) == (str,) and value is not None
    ):  # a list of words (--data-mixture): each as a string
        return [str(v) for v in value] if isinstance(value, (list, tuple, ListConfig)) else value.split()
    if isinstance(value, (list, tuple, ListConfig)) and not is_list:
        if len(value) == 1:
            return value[0]
        why = PER_EPOCH_LISTS.get(key, "it takes one value, not a list")
        raise UsageError(f"{source}: {key}={list(value)}: {why}")
    if is_list and isinstance(value, str):
        try:
            return parse_float_list(value)
        except Exception:
            raise UsageError(f'cannot read {key}={value!r}: expected a list like "(0.9, 0.98)"') from None
    if isinstance(value, tuple):
        return list(value)
    return value


def group_option(group, name, config_dir=None):
    """Option NAME of GROUP as (its label, its settings, the file they come from or None).

    Searched as Hydra searches: <--config-dir>/<group>/<NAME>.yaml, shardlm's conf/ (which
    ships fairseq's model/transformer_lm/*.yaml), then the options registered in schema.py.
    A file sets every key it lists. Its label (the group's `_name`) is the file's own
    `_name`, else the first of NAME's last two parts that names a registered option
    (`transformer_lm/transformer_lm_gpt` is transformer_lm_gpt, `transformer_lm/2_layers`
    transformer_lm), else NAME: `--arch`'s presets keep their names and meaning.
    """
    name, options = str(name), GROUP_OPTIONS[group]
    if group == "model" and is_hf_dir(name):  # the model of a run fine-tuned from HF_DIR, as its config.yaml names it
        fixed, defaults = hf_model_settings(name)
        return name, [(f"model.{k}", v) for k, v in {**defaults, **fixed}.items()], str(Path(name) / HF_CONFIG)
    parts = name.split("/")
    if ".." not in parts and not name.startswith("/"):  # a name, not a way out of the search path
        for root in ([Path(config_dir)] if config_dir else []) + [CONF_DIR]:
            path = root / group / f"{name}.yaml"
            if path.is_file():
                node = _load_yaml(path, group)
                if node is not None and not isinstance(node, dict):
                    raise UsageError(f"{path} must be a mapping of {group} keys, e.g. `decoder_layers: 4`")
                node = dict(node or {})
                label = node.pop("_name", None) or next((p for p in parts[::-1][:2] if p in options), name)
                return label, [(f"{group}.{k}", v) for k, v in node.items()], str(path)
    if name not in options:
        files = sorted(
            str(p.relative_to(root / group).with_suffix(""))
            for root in {CONF_DIR, Path(config_dir or CONF_DIR)}
            for p in (root / group).rglob("*.yaml")
        )
        near = difflib.get_close_matches(name, list(options) + files, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]}?" if near else "choose one of: " + ", ".join(list(options) + files)
        raise UsageError(f"unknown {group} {name!r} ({hint})")
    return name, [(f"{group}.{k}", v) for k, v in options[name].items()], None


def unknown_key_message(key):
    keys = list(FIELD_TYPES) + list(KEY_ALIASES)
    # A field's own name without its group (`update_freq`) is that field, not the nearest
    # whole key (ema.ema_update_freq is nearer to it than optimization.update_freq).
    near = [k for k in keys if k.split(".")[-1] == key] or difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not near:  # `max_updat` without its group still deserves a hint
        by_leaf = {k.split(".")[1]: k for k in keys}
        leaf = difflib.get_close_matches(key.split(".")[-1], list(by_leaf), n=1, cutoff=0.6)
        near = [by_leaf[leaf[0]]] if leaf else []
    hint = f" (did you mean {near[0]}?)" if near else "; see `train --help`"
    return f"unknown config key {key}{hint}"


def override_settings(overrides):
    """Hydra's override grammar: `optimization.lr=0.001`, `model=transformer_lm/transformer_lm_gpt`."""
    if not overrides:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    settings = []
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except HydraException as e:
            raise UsageError(f"cannot parse override {text!r}: {str(e).splitlines()[0]}") from None
        if ov.is_add() or ov.is_delete() or ov.is_force_add():
            raise UsageError(f"override {text!r}: keys cannot be added or deleted; set an existing key as key=value")
        key = ov.key_or_group
        if key in GROUP_OPTIONS or key in ABSENT_GROUPS:
            key += "._name"
        settings.append((key, ov.value()))
    return settings


def _package(text):
    """The `# @package X` of a YAML file's Hydra header (its leading `# @` lines), or None."""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        match = re.match(r"#\s*@package\s+(\S+)\s*$", line)
        if match:
            return match.group(1)
        if not re.match(r"#\s*@", line):
            return None
    return None


def _load_yaml(path, group=None):
    """A YAML file's contents as plain containers; a parse error is one line naming the file.
    A Hydra header `# @package _group_` (fairseq's files have it) says what no header says:
    the keys are GROUP's, or the top level's in an experiment file. Another package would
    move the keys elsewhere, which this reader does not do: refused."""
    import yaml

    try:
        package = _package(Path(path).read_text())
        data = OmegaConf.to_container(OmegaConf.load(path))
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if package not in (None, "_group_", group or "_global_"):
        where = f"the {group} group's" if group else "top-level"
        raise UsageError(
            f"{path}: `# @package {package}` is not supported: its keys are read as {where} keys; "
            "use `# @package _group_` or no header"
        )
    return data


def file_settings(config_dir, config_name):
    """An experiment YAML file as layers of settings, in its defaults list's order (Hydra's):
    the options listed before `_self_`, the file's own keys, the options listed after it.
    Without `_self_` the file's keys come last, as in Hydra 1.1+. The file lists only the
    keys it changes."""
    path = Path(config_dir or ".") / f"{config_name}.yaml"
    if not path.is_file():
        raise UsageError(f"no config file {path}: check --config-dir and --config-name (name without .yaml)")
    data = _load_yaml(path)
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UsageError(f"{path} must be a mapping of config groups, e.g. `optimization: {{max_update: 100}}`")
    defaults = data.pop("defaults", None) or []
    if not isinstance(defaults, list):
        raise UsageError(f"{path}: defaults must be a list of `- GROUP: OPTION` entries")
    before, own, after = [], [], []
    listed = before
    for entry in defaults:
        if entry == "_self_":
            if listed is after:
                raise UsageError(f"{path}: `_self_` is listed twice in defaults; keep one")
            listed = after
        else:
            listed.extend(_defaults_entry(path, entry))
    for group, node in data.items():
        if group == "hydra" or group in ABSENT_GROUPS:
            own.extend(_flatten(group if isinstance(node, dict) or group == "hydra" else f"{group}._name", node))
            continue
        if group not in GROUPS:
            near = difflib.get_close_matches(group, GROUPS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else f"; groups are {', '.join(GROUPS)}"
            raise UsageError(f"{path}: unknown config group {group!r}{hint}")
        if isinstance(node, str) and group in GROUP_OPTIONS:  # `optimizer: adamw`
            own.append((f"{group}._name", node))
        elif isinstance(node, dict):
            own.extend((f"{group}.{k}", v) for k, v in node.items())
        elif node is not None:
            raise UsageError(f"{path}: {group} must be a mapping of keys, not {node!r}")
    return [before, own, after]


def _defaults_entry(path, entry):
    """`- GROUP: OPTION` of a defaults list as settings; `- GROUP: null` selects nothing, as in
    Hydra (the group keeps shardlm's default option)."""
    if entry == "shardlm_schema":  # conf/config.yaml's first entry: the schema every config starts from
        return []
    if not isinstance(entry, dict):
        raise UsageError(f"{path}: defaults entry {entry!r} is neither `- GROUP: OPTION` nor `_self_`")
    settings = []
    for group, name in entry.items():
        group = group.replace("override ", "").replace("optional ", "").strip().lstrip("/")
        if group.startswith("hydra"):
            settings.append((group, name))  # refused by check_hydra_setting, with the way to use it
        elif group in ABSENT_GROUPS:
            settings.append((f"{group}._name", name))
        elif group in GROUP_OPTIONS:
            if name is not None:
                settings.append((f"{group}._name", name))
        else:
            raise UsageError(f"{path}: unknown defaults entry {group!r}; groups are {', '.join(GROUP_OPTIONS)}")
    return settings


def _flatten(key, node):
    """{'run': {'dir': '.'}} under 'hydra' → [('hydra.run.dir', '.')]."""
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in _flatten(f"{key}.{k}", v)]
    return [(key, node)]
