// main.cpp — the libFuzzer entry of one target, picked at compile time: -DTARGET=nanovllm_fuzz_config etc.
// The targets themselves (and what each checks) are in targets.cu; `make fuzz` builds and runs all four.
#include <cstddef>
#include <cstdint>

extern "C" int TARGET(const uint8_t* data, size_t size);

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return TARGET(data, size); }
