"""Compose the run's config from the three ways of setting it.

Precedence, lowest first: the experiment file (--config-dir/--config-name), then the
--arch preset, then flags, then dotted overrides. Each of the three sources is a layer
of (dotted key, value) settings; inside a layer a group selection (`model=NAME`,
`--arch NAME`, `optimizer: adamw` in a file) is applied before the layer's other keys,
so `--arch X --decoder-layers 4` gives X with 4 layers, as fairseq's arch functions do.
A selection sets only the keys its option names (fairseq's getattr-default semantics).
"""
import difflib
import typing
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config.schema import GROUP_OPTIONS, GROUPS, register_configs
from trainer.errors import UsageError
from trainer.config.flags import iter_fields, parse_float_list

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
FIELD_TYPES = {f"{g}.{f.name}": f.type for g, f in iter_fields()}


def compose_config(flag_settings, overrides, config_dir=None, config_name=None) -> DictConfig:
    cfg = base_config()
    layers = []
    if config_name:
        layers.append(("config file", file_settings(config_dir, config_name)))
    elif config_dir:
        raise UsageError("--config-dir needs --config-name NAME (the YAML file without .yaml)")
    layers.append(("flag", list(flag_settings)))
    layers.append(("override", override_settings(overrides)))
    for source, settings in layers:
        selections = [s for s in settings if _is_selection(s[0])]
        for key, value in selections + [s for s in settings if not _is_selection(s[0])]:
            apply_setting(cfg, key, value, source, config_dir)
    return cfg


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


def apply_setting(cfg, key, value, source, config_dir=None):
    if key not in FIELD_TYPES:
        raise UsageError(f"{source}: {unknown_key_message(key)}")
    value = _normalize(key, value)
    if _is_selection(key):
        group = key.split(".")[0]
        for k, v in group_option(group, value, config_dir).items():
            _set(cfg, f"{group}.{k}", v, source)
    _set(cfg, key, value, source)


def _set(cfg, key, value, source):
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except OmegaConfBaseException as e:
        reason = str(e).splitlines()[0]
        raise UsageError(f"{source}: cannot set {key}={value!r}: {reason}") from None


def _normalize(key, value):
    """Accept fairseq's spellings: `lr: [0.0005]` for a scalar, "(0.9,0.98)" for a list."""
    tp = FIELD_TYPES[key]
    is_list = typing.get_origin(tp) in (list, typing.List)
    if isinstance(value, (list, tuple, ListConfig)) and not is_list and len(value) == 1:
        return value[0]
    if is_list and isinstance(value, str):
        try:
            return parse_float_list(value)
        except Exception:
            raise UsageError(f"cannot read {key}={value!r}: expected a list like \"(0.9, 0.98)\"") from None
    if isinstance(value, tuple):
        return list(value)
    return value


def group_option(group, name, config_dir=None):
    """The keys option NAME of GROUP sets: <config-dir>/<group>/<name>.yaml, else a registered one."""
    path = Path(config_dir or ".") / group / f"{name}.yaml"
    if config_dir and path.is_file():
        node = _load_yaml(path)
        if node is not None and not isinstance(node, dict):
            raise UsageError(f"{path} must be a mapping of {group} keys, e.g. `decoder_layers: 4`")
        node = dict(node or {})
        node.pop("_name", None)
        return node
    options = GROUP_OPTIONS[group]
    if name not in options:
        near = difflib.get_close_matches(str(name), options, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]}?" if near else "choose one of: " + ", ".join(options)
        raise UsageError(f"unknown {group} {name!r} ({hint})")
    return options[name]


def unknown_key_message(key):
    near = difflib.get_close_matches(key, list(FIELD_TYPES), n=1, cutoff=0.6)
    if not near:  # `max_updat` without its group still deserves a hint
        by_leaf = {k.split(".")[1]: k for k in FIELD_TYPES}
        leaf = difflib.get_close_matches(key.split(".")[-1], list(by_leaf), n=1, cutoff=0.6)
        near = [by_leaf[leaf[0]]] if leaf else []
    hint = f" (did you mean {near[0]}?)" if near else "; see `train --help`"
    return f"unknown config key {key}{hint}"


def override_settings(overrides):
    """Hydra's override grammar: `optimization.lr=0.001`, `model=transformer_lm_gpt`."""
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
        if key in GROUP_OPTIONS:
            key += "._name"
        settings.append((key, ov.value()))
    return settings


def _load_yaml(path):
    """A YAML file's contents as plain containers; a parse error is one line naming the file."""
    import yaml
    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None


def file_settings(config_dir, config_name):
    """An experiment YAML file as settings; it lists only the keys it changes."""
    path = Path(config_dir or ".") / f"{config_name}.yaml"
    if not path.is_file():
        raise UsageError(f"no config file {path}: check --config-dir and --config-name (name without .yaml)")
    data = _load_yaml(path)
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UsageError(f"{path} must be a mapping of config groups, e.g. `optimization: {{max_update: 100}}`")
    settings = []
    for entry in data.pop("defaults", None) or []:  # Hydra defaults list: `- model: NAME`
        if isinstance(entry, dict):
            for group, name in entry.items():
                group = group.replace("override ", "").strip().lstrip("/")
                if group in GROUP_OPTIONS:
                    settings.append((f"{group}._name", name))
                else:
                    raise UsageError(f"{path}: unknown defaults entry {group!r}; groups are {', '.join(GROUP_OPTIONS)}")
    for group, node in data.items():
        if group not in GROUPS:
            near = difflib.get_close_matches(group, GROUPS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else f"; groups are {', '.join(GROUPS)}"
            raise UsageError(f"{path}: unknown config group {group!r}{hint}")
        if isinstance(node, str) and group in GROUP_OPTIONS:  # `optimizer: adamw`
            settings.append((f"{group}._name", node))
        elif isinstance(node, dict):
            settings.extend((f"{group}.{k}", v) for k, v in node.items())
        elif node is not None:
            raise UsageError(f"{path}: {group} must be a mapping of keys, not {node!r}")
    return [(k, v) for k, v in settings]
