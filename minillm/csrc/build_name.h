// The name of the build being compiled, for kernels built once per instruction set.
//
// cpp_extension.load passes -DMINILLM_ISA=avx2 (or avx512, avx512bf16) when it builds a
// source for a named ISA; a kernel puts MINILLM_ISA_NAME into its operators' names
// (minillm_cpu::small_m_linear_avx2, ...) so that several builds of one source load into
// one process side by side, and exports it as the module's `isa`.
#pragma once

#ifndef MINILLM_ISA
#define MINILLM_ISA default
#endif
#define MINILLM_STR2(x) #x
#define MINILLM_STR(x) MINILLM_STR2(x)
#define MINILLM_ISA_NAME MINILLM_STR(MINILLM_ISA)
