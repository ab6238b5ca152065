# nanovllm.cu — plain nvcc, no CMake.
#
#   make               build ./nanovllm for the visible GPU (or sm_80/86/89/90 when none is visible)
#   make test          build (one job per core) and run every test (GPU suites are skipped, and say so,
#                      without a GPU; there the CLI suites run build/nanovllm, a host-only build)
#   make bench         run ./bench.sh
#   make fuzz          run each libFuzzer target (test/fuzz) for FUZZ_SECONDS (60); needs clang + libFuzzer
#   make clean
#
# Knobs: CUDA_ARCH=90a (or 80, 86, ...: one target), NVCC=..., SANITIZE=1 (host tests under ASan+UBSan),
#        UTF8PROC_LIB=path/to/libutf8proc.a, EXTRA_INCLUDES=-I..., CLANGXX=clang++, FUZZ_SECONDS=60

NVCC      ?= nvcc
export UTF8PROC_LIB
BUILD     := build
SHELL     := /bin/bash

# ---- GPU architecture ---------------------------------------------------------------------------------
# Host suites, the fuzz targets and the CPU-only test binary never launch a kernel: their device code only
# has to compile. PTX for one architecture, with the device optimiser off (cicc -O0) and no ptxas, costs
# about a sixth of an sm_80 build; the host code keeps NVFLAGS's -O3.
HOST_GENCODE    := -gencode=arch=compute_80,code=compute_80 -Xcicc -O0
HOST_ONLY_GOALS := test test-build fuzz fuzz-build clean $(BUILD)/test_% $(BUILD)/host_suites% \
                   $(BUILD)/nanovllm $(BUILD)/fuzz/%
# The visible GPU's compute capability, else a fat binary for A100, RTX 30, RTX 40 and H100.
ifeq ($(origin CUDA_ARCH), undefined)
  CUDA_ARCH := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '. ')
  ifeq ($(CUDA_ARCH),90)
    CUDA_ARCH := 90a
  endif
endif
ifeq ($(strip $(CUDA_ARCH)),)
  GENCODE    := -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_86,code=sm_86 \
                -gencode=arch=compute_89,code=sm_89 -gencode=arch=compute_90a,code=sm_90a \
                -gencode=arch=compute_90,code=compute_90
  ARCH_NAME  := sm_80+sm_86+sm_89+sm_90a (no GPU visible: fat binary)
  ifneq ($(MAKECMDGOALS),)
    ifeq ($(filter-out $(HOST_ONLY_GOALS),$(MAKECMDGOALS)),)
      ARCH_NAME := none visible; these goals build host-only device code ($(HOST_GENCODE))
    endif
  endif
else
  GENCODE    := -gencode=arch=compute_$(CUDA_ARCH),code=sm_$(CUDA_ARCH)
  ARCH_NAME  := sm_$(CUDA_ARCH)
endif

# ---- dependencies --------------------------------------------------------------------------------------
EXTRA_INCLUDES ?=

NVFLAGS  := -std=c++17 -O3 -lineinfo -Xcompiler -Wall,-Wno-unused-function $(EXTRA_INCLUDES) \
            --expt-relaxed-constexpr -diag-suppress 177,550
# utf8proc is looked up when linking, after `deps` may have installed it.
LDLIBS   := -lcublasLt -lnccl $$(bash tools/deps.sh --utf8proc-lib)
ifeq ($(SANITIZE),1)
  # -fno-sanitize-recover: an UndefinedBehaviorSanitizer report stops the test (a failure), not a warning.
  HOSTSAN := -Xcompiler -fsanitize=address -Xcompiler -fsanitize=undefined -Xcompiler -fno-omit-frame-pointer \
             -Xcompiler -fno-sanitize-recover=all
endif

HEADERS  := nanovllm.cu safetensors.h tokenizer.h
GPU_TESTS  := $(patsubst test/gpu/%.cu,$(BUILD)/%,$(wildcard test/gpu/gpu_*.cu))

# ---- fuzzing ------------------------------------------------------------------------------------------
# The targets (test/fuzz/targets.cu) include nanovllm.cu like every test, so nvcc compiles them with clang as
# its host compiler: that is what adds libFuzzer's coverage hooks and the sanitizers to the host code. Device
# code is PTX for one architecture (never run). One object, five small entry points (test/fuzz/main.cpp).
CLANGXX      ?= clang++
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := safetensors config tokenizer tokenizer_json prompts
FUZZ_BINS    := $(patsubst %,$(BUILD)/fuzz/fuzz_%,$(FUZZ_TARGETS))
FUZZ_SAN     := -fsanitize=address -fsanitize=undefined -fno-sanitize-recover=all
# Whether $(CLANGXX) can link a libFuzzer binary (Debian: apt-get install clang libclang-rt-dev).
LIBFUZZER_PROBE := echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, long) { return 0; }' | \
                   $(CLANGXX) -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null

.PHONY: all deps test test-build bench clean fuzz fuzz-build FORCE
all: deps nanovllm

# Print what was found; install a missing Debian package when root, else print the command and stop.
deps:
	@CUDA_ARCH_NAME="$(ARCH_NAME)" NVCC="$(NVCC)" \
	  EXTRA_INCLUDES="$(EXTRA_INCLUDES)" bash tools/deps.sh

nanovllm: $(HEADERS) | deps
	$(NVCC) $(NVFLAGS) $(GENCODE) -o $@ nanovllm.cu $(LDLIBS)

$(BUILD)/test_%: test/host/test_%.cu test/test.h test/engine_fixtures.h test/tokenizer_fixture.h $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(NVCC) $(NVFLAGS) $(HOST_GENCODE) $(HOSTSAN) -o $@ $< $(LDLIBS)

# `make test` builds the host suites as one program (test/host_suites.sh writes it): nanovllm.cu is compiled
# once, not once per suite, and run.sh still runs each suite in its own process. The source is rewritten
# every time and replaced only when it changed.
$(BUILD)/host_suites.cu: FORCE
	@mkdir -p $(BUILD)
	@bash test/host_suites.sh >$@.new && { cmp -s $@.new $@ && rm $@.new || mv $@.new $@; }

$(BUILD)/host_suites: $(BUILD)/host_suites.cu test/test.h test/engine_fixtures.h test/tokenizer_fixture.h \
                      test/fuzz/targets.cu $(HEADERS) | deps
	$(NVCC) $(NVFLAGS) $(HOST_GENCODE) $(HOSTSAN) -o $@ $< $(LDLIBS)

$(BUILD)/gpu_%: test/gpu/gpu_%.cu test/test.h test/gpu/gpu_fixtures.h $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(NVCC) $(NVFLAGS) $(GENCODE) -o $@ $< $(LDLIBS)

$(BUILD)/fuzz/targets.o: test/fuzz/targets.cu $(HEADERS) | deps
	@mkdir -p $(BUILD)/fuzz
	$(NVCC) -ccbin $(CLANGXX) -std=c++17 -O1 -g --expt-relaxed-constexpr -diag-suppress 177,550 \
	  $(EXTRA_INCLUDES) $(HOST_GENCODE) -Xcompiler=-fsanitize=fuzzer-no-link \
	  $(addprefix -Xcompiler=,$(FUZZ_SAN)) -c -o $@ $<

$(BUILD)/fuzz/fuzz_%: test/fuzz/main.cpp $(BUILD)/fuzz/targets.o
	$(CLANGXX) -c -DTARGET=nanovllm_fuzz_$* -o $@.o $<
	$(NVCC) -ccbin $(CLANGXX) -Xcompiler=-fsanitize=fuzzer $(addprefix -Xcompiler=,$(FUZZ_SAN)) \
	  -o $@ $@.o $(BUILD)/fuzz/targets.o $(LDLIBS)

fuzz-build: | deps
	@if $(LIBFUZZER_PROBE); then $(MAKE) --no-print-directory -o deps $(FUZZ_BINS); \
	 else echo "fuzz: $(CLANGXX) cannot link libFuzzer binaries, fuzz targets not built" \
	           "(apt-get install clang libclang-rt-dev)"; fi

# Each target for FUZZ_SECONDS, growing a corpus in build/fuzz/corpus-NAME from test/fuzz/corpus/NAME.
fuzz: fuzz-build
	@FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_KEEP_CORPUS=1 bash test/fuzz/fuzz.sh $(BUILD)

# The CLI suites' binary. Where a GPU is visible (or CUDA_ARCH is given) it is ./nanovllm. Elsewhere nothing
# launches a kernel, so `make test` builds $(BUILD)/nanovllm with HOST_GENCODE instead of the fat binary and
# leaves ./nanovllm to `make`.
$(BUILD)/nanovllm: $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(NVCC) $(NVFLAGS) $(HOST_GENCODE) -o $@ nanovllm.cu $(LDLIBS)

# GPU test binaries are only built where a GPU is visible (or CUDA_ARCH is given). The fuzz targets are built
# where clang can link them; test/fuzz/fuzz.sh then gives each a short pass (FUZZ_SECONDS=10).
ifeq ($(strip $(CUDA_ARCH)),)
TEST_BIN := $(BUILD)/nanovllm
test-build: $(TEST_BIN) $(BUILD)/host_suites fuzz-build
else
TEST_BIN := nanovllm
test-build: $(TEST_BIN) $(BUILD)/host_suites $(GPU_TESTS) fuzz-build
endif

# `make test` builds with one job per core (TEST_JOBS; a -j given to make wins), each target's output in one
# piece (-Otarget), then runs test/run.sh, which runs TEST_JOBS suites at a time.
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test:
	@echo "make test: building with $(if $(findstring -j,$(MAKEFLAGS)),make's -j,-j$(TEST_JOBS))"
	@$(MAKE) --no-print-directory $(if $(findstring -j,$(MAKEFLAGS)),,-j$(TEST_JOBS)) -Otarget test-build
	@TEST_JOBS=$(TEST_JOBS) NANOVLLM_BIN=$(TEST_BIN) HOST_SUITES=$(BUILD)/host_suites bash test/run.sh $(BUILD)

bench: nanovllm
	./bench.sh

clean:
	rm -rf $(BUILD) nanovllm
