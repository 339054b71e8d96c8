"""Convert a Hugging Face checkpoint to a jaxkv directory: orbax params + the original metadata.

    python -m jaxkv.convert HF_DIR OUT_DIR [--dtype bfloat16]

OUT_DIR holds `params/` (an orbax StandardCheckpointer tree in the layout of `jaxkv.models.llama`),
copies of config.json, tokenizer files and generation_config.json, and `jaxkv_convert.json` recording
the saved dtype. `jaxkv.load(OUT_DIR)` restores it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax.numpy as jnp

from jaxkv.loading import CONVERT_FORMAT, CONVERT_META, load, resolve_dtype

METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "head_classes.json",
)


def convert(hf_dir: str | Path, out_dir: str | Path, dtype="bfloat16") -> Path:
    """Load `hf_dir`, save its params with orbax under out_dir/params, copy the metadata files."""
    import orbax.checkpoint as ocp

    hf_dir, out_dir = Path(hf_dir), Path(out_dir).resolve()
    dt = resolve_dtype(dtype)
    model = load(hf_dir, dtype=dt)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "params").exists():
        raise FileExistsError(f"{out_dir / 'params'} already exists")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out_dir / "params", model.params)
        ckptr.wait_until_finished()
    for name in METADATA_FILES:
        if (hf_dir / name).exists():
            shutil.copy2(hf_dir / name, out_dir / name)
    meta = {"format": CONVERT_FORMAT, "dtype": jnp.dtype(dt).name, "source": str(hf_dir.resolve())}
    (out_dir / CONVERT_META).write_text(json.dumps(meta, indent=2))
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.convert", description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    parser.add_argument("out_dir", help="output directory (params/ must not exist yet)")
    parser.add_argument("--dtype", default="bfloat16", help="saved parameter dtype (default bfloat16)")
    args = parser.parse_args(argv)
    out = convert(args.hf_dir, args.out_dir, args.dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
