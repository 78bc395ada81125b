// Kernels called with cuLaunchKernel's arguments (an array of addresses, one per parameter),
// so a launcher written for the driver can run on the emulator unchanged. The build appends
// AVA_EMU_KERNEL(name) for every `extern "C"` kernel of a file to a unit that includes it.
#pragma once

#include <stddef.h>
#include <utility>

namespace ava_emu {
template <typename... A, size_t... I> void unpack(void (*f)(A...), void **p, std::index_sequence<I...>) {
    f(*static_cast<A *>(p[I])...);
}
template <typename... A> void call(void (*f)(A...), void **p) { unpack(f, p, std::index_sequence_for<A...>{}); }
template <typename... A> constexpr unsigned arity(void (*)(A...)) { return sizeof...(A); }
} // namespace ava_emu

#define AVA_EMU_KERNEL(name)                                                                                       \
    extern "C" void ava_emu_call_##name(void **p) { ava_emu::call(&name, p); }                                     \
    extern "C" unsigned ava_emu_arity_##name() { return ava_emu::arity(&name); }
