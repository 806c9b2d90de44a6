# closbox: a GPU-cluster network fabric on one Linux box.
CARGO ?= cargo

.PHONY: all build demo demo-default test test-deps bench bench-live faithful lint fmt clean

all: build

build:
	$(CARGO) build --release --workspace

# The main job: a guided tour (scripts/tour) of what GPU fabrics do, each step measured on
# a shipped fabric beside the model's prediction: plan at 200,000 GPUs, scale-up vs
# scale-out, oversubscription, incast, ECMP collisions, overlap, a spine failing. Results
# and plots in tour/index.md. Needs root; ~3-5 min (7-25 when the host steals CPU
# time). `make demo-STEP` runs one step
# (demo-plan, demo-scale-up, demo-oversubscription, demo-incast, demo-ecmp, demo-overlap,
# demo-chaos, demo-lossless).
CLOSBOX = ./target/release/closbox
demo: build
	scripts/tour

# The AllReduce sweep and training steps of the default fabric alone (the demo before
# the tour): up, sweep with a plot, train, status, down.
demo-default: build
	$(CLOSBOX) plan configs/default.toml
	$(CLOSBOX) up configs/default.toml --detach
	$(CLOSBOX) bench allreduce --fabric default --sizes 64K:32M --iters 2 --plot allreduce.svg || { $(CLOSBOX) down default; exit 1; }
	$(CLOSBOX) train --fabric default --model 64M --bucket 8M --compute-ms 2 --steps 2 || { $(CLOSBOX) down default; exit 1; }
	-$(CLOSBOX) status default
	$(CLOSBOX) down default

demo-%: build
	scripts/tour $*

# Every test: unit, virtual-clock model tests, CLI tests and, as root, live fabrics running
# real programs. Installs those programs first if they are missing (scripts/test-deps).
test: test-deps build
	$(CARGO) test --workspace --release
	# The model once more with debug assertions and overflow checks (its time-order
	# contract, its byte accounting).
	$(CARGO) test -p closbox-fabric

test-deps:
	@scripts/test-deps

# Model throughput (criterion): packet-hops per second on one core.
bench:
	$(CARGO) bench -p closbox-fabric --bench model

# Root: every shipped fabric (configs/*.toml, as shipped) benchmarked against the model:
# within 10 % and not behind, or the config says why not.
faithful: build
	scripts/faithful

# Root: closbox against a kernel veth pair and two bare offload TUN relays, and 8 gloo ranks
# and NetPIPE against an htb-shaped kernel bridge, same run (~3 min).
bench-live:
	$(CARGO) build --release --workspace
	$(CARGO) build --release -p closbox-switchd --example tun_relay
	scripts/bench-live

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings
	scripts/check-features

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
