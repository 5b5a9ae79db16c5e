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


def optimise(module_ir: str, tm, triple: str, speed_level: int):
    """Parse, verify, optimise and verify `module_ir` for the target machine `tm`: the
    one optimisation pipeline, in process (cannc.native.target) and here."""
    import llvmlite.binding as llvm

    mod = llvm.parse_assembly(module_ir)
    mod.verify()
    mod.triple = triple
    mod.data_layout = str(tm.target_data)
    pto = llvm.create_pipeline_tuning_options(speed_level=speed_level)
    pto.loop_vectorization = speed_level >= 2
    pto.slp_vectorization = speed_level >= 2
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    mod.verify()
    return mod


def main() -> int:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
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
