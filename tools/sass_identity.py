"""Dump per-function SASS (nvdisasm) of every forward specialisation for sm_80 and sm_90a."""
import hashlib, json, re, subprocess, sys, tempfile
from cuflash import _jit, _launch
from cuda import pathfinder
tool = pathfinder.find_nvidia_binary_utility("nvdisasm")
out = {}
for arch in ("sm_80", "sm_90a"):
    by = {}
    for src, e in _launch.all_specialisations(arch):
        if src.startswith("fwd_"):
            by.setdefault(src, []).append(e)
    for src, exprs in by.items():
        nv = _jit._nvrtc_for(arch)
        log, lowered, cubin = nv.compile(_jit.load_source(src), src, exprs, _jit._options(arch))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin); f.flush()
            sass = subprocess.run([tool, f.name], capture_output=True, text=True).stdout
        secs = {}
        for section in re.split(r"^\s*\.section\s+\.text\.", sass, flags=re.MULTILINE)[1:]:
            name = section.split(",", 1)[0]
            # drop address comments
            body = "\n".join(l for l in re.sub(r"/\*[0-9a-f]{4,}\*/", "", section).splitlines() if l.rstrip().endswith(";"))
            secs[name] = hashlib.sha256(body.encode()).hexdigest()
        for e in exprs:
            out[f"{arch} {e}"] = secs.get(lowered[e])
json.dump(out, open(sys.argv[1], "w"), indent=0, sort_keys=True)
print(len(out))
