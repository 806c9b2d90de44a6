# closbox: a GPU-cluster network fabric on one Linux box.
CARGO ?= cargo

.PHONY: all build demo test bench lint fmt clean

all: build

build:
	$(CARGO) build --release --workspace

# The main job on the default fabric (see README).
demo: build
	./target/release/closbox plan configs/superpod-su.toml
	@echo
	./target/release/closbox plan --gpus 200000 --topology fat-tree --radix 64

# Every test: unit, virtual-clock model tests, CLI tests (and, as root, live fabrics).
test:
	$(CARGO) test --workspace --release

# Model throughput (criterion): packet-hops per second on one core.
bench:
	$(CARGO) bench -p closbox-fabric --bench model

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
