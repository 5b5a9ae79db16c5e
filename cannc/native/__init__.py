"""The native target: LLVM initialisation, this host's CPU, the object cache, JIT loading,
and the small IR-building helpers every emitter shares. Below codegen and runtime."""
