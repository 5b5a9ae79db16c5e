"""An LLVM worker process (cannc.native.llvm_procs starts it as a script, so that it
imports llvmlite only, not cannc: it is ready in ~0.1 s).

Says ("ready", LLVM version) once LLVM is initialised, then reads jobs from stdin and
answers on stdout, each a pickled tuple after its length (8 bytes, little-endian):

    job:    (triple, cpu, features, opt, reloc, codemodel, speed_level, name, module_ir)
    answer: ("ok", object bytes) | ("error", message)

It optimises with `optimise`, the function cannc.native.target uses in process, for
a target machine made as HostTarget.machine makes it; an end of stdin ends it.
"""

import pickle
import struct
import sys


def _read(f, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            return b""
        out += chunk
    return out


# The named metadata by which a module says that it is vector code already, its loops
# unrolled as far as its generator chose (cannc.native.emit.mark_vector_code: the GEMM
# and convolution kernels). At speed level 2 such a module is optimised at O1 without
# LLVM's loop unroller and vectorisers: they found nothing to vectorise there, and the
# unroller only copied remainder loops, while O2's passes cost 40% more time. BERT-base's
# four GEMM modules took 0.67 s each to optimise and emit, 0.40 s so, with the same
# kernel speed (Sapphire Rapids guest: gemm_bench 1024^3 and 128x768x768 level; BERT-base,
# ResNet-50, MobileNetV2, EfficientNet-B0 at batch 1 within 3%, these kernels and every
# other module at O1 without the vectorisers).
VECTOR_CODE = "cannc.vector_code"


# LLVM's codegen options, set once per process (in process by cannc.native.target.init,
# here by main). -disable-lsr: Loop Strength Reduction took 60% of code generation on
# the convolution kernels (ResNet-18's 3x3 modules 0.13-0.29 s each of emit_object,
# 0.03-0.06 s without it) and changed no kernel's speed measurably: ResNet-18/50,
# EfficientNet-B0, MobileNetV2, ConvNeXt-T, BERT-base, GPT-2, MiniLM and the 1024^3 GEMM
# level at AVX-512 and AVX2 (Zen 4); the objects came out 1-15% smaller.
CODEGEN_OPTIONS = ("-disable-lsr",)


def configure(llvm) -> None:
    """Set CODEGEN_OPTIONS in this process's LLVM (llvmlite.binding as `llvm`)."""
    for option in CODEGEN_OPTIONS:
        llvm.set_option("cannc", option)


def pipeline(module_ir: str, speed_level: int) -> tuple[int, bool, bool]:
    """(LLVM speed level, whether LLVM vectorises loops, whether it unrolls them) for
    `module_ir` asked for at `speed_level`."""
    if speed_level >= 2 and f"\n!{VECTOR_CODE} = " in module_ir:
        return 1, False, False
    return speed_level, speed_level >= 2, True


def optimise(module_ir: str, tm, triple: str, speed_level: int):
    """Parse, verify, optimise and verify `module_ir` for the target machine `tm`: the
    one optimisation pipeline, in process (cannc.native.target) and here."""
    import llvmlite.binding as llvm

    mod = llvm.parse_assembly(module_ir)
    mod.verify()
    mod.triple = triple
    mod.data_layout = str(tm.target_data)
    level, vectorise, unroll = pipeline(module_ir, speed_level)
    pto = llvm.create_pipeline_tuning_options(speed_level=level)
    pto.loop_vectorization = vectorise
    pto.slp_vectorization = vectorise
    pto.loop_unrolling = unroll
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    mod.verify()
    return mod


def main() -> int:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    configure(llvm)
    machines: dict = {}
    fin, fout = sys.stdin.buffer, sys.stdout.buffer
    _write(fout, ("ready", llvm.llvm_version_info))
    while True:
        head = _read(fin, 8)
        if not head:
            return 0
        job = pickle.loads(_read(fin, struct.unpack("<Q", head)[0]))
        triple, cpu, features, opt, reloc, codemodel, speed_level, name, module_ir = job
        try:
            key = (triple, cpu, features, opt, reloc, codemodel)
            tm = machines.get(key)
            if tm is None:
                tm = machines[key] = llvm.Target.from_triple(triple).create_target_machine(
                    cpu=cpu, features=features, opt=opt, reloc=reloc, codemodel=codemodel)
            answer = ("ok", tm.emit_object(optimise(module_ir, tm, triple, speed_level)))
        except Exception as e:          # invalid IR: the parent raises CompileError
            answer = ("error", f"{type(e).__name__}: {e}")
        _write(fout, answer)


def _write(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


if __name__ == "__main__":
    sys.exit(main())
