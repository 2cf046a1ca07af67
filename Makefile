# stor — make targets a newcomer guesses.
GO ?= go
BIN ?= bin
PROTOC_GEN_GO_VERSION ?= v1.36.12
PROTOC_GEN_GO_GRPC_VERSION ?= v1.6.0

.PHONY: build test test-short e2e lint proto verify-proto cluster bench clean
.PHONY: install-nbd-tools test-nbd fuzz-nbd vm install-vm-tools bench-nbd
.PHONY: image-binaries images test-deploy
.PHONY: test-csi vm-csi bench-csi
.PHONY: jepsen jepsen-soak
.PHONY: k8s k8s-tools docs

build:
	CGO_ENABLED=0 $(GO) build -o $(BIN)/ ./cmd/...

test:
	$(GO) test -race -count=1 -timeout 25m ./...

# The unit and in-process tests only: -short skips the multi-process e2e tests.
test-short:
	$(GO) test -short -count=1 ./...

# The multi-process end-to-end tests (internal/e2etest), verbose.
e2e:
	$(GO) test -race -count=1 -timeout 10m -v ./internal/e2etest/

# A three-server cluster on 127.0.0.1 in the foreground; Ctrl-C stops it.
cluster:
	./scripts/local-cluster.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

$(BIN)/protoc-gen-go:
	GOBIN=$(abspath $(BIN)) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)

$(BIN)/protoc-gen-go-grpc:
	GOBIN=$(abspath $(BIN)) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)

# protoc comes from Debian's protobuf-compiler (apt-get install protobuf-compiler).
# PROTO_OUT is where the generated code goes (verify-proto points it elsewhere).
PROTO_OUT ?= api/proto
proto: $(BIN)/protoc-gen-go $(BIN)/protoc-gen-go-grpc
	protoc --plugin=protoc-gen-go=$(BIN)/protoc-gen-go --plugin=protoc-gen-go-grpc=$(BIN)/protoc-gen-go-grpc \
		-I api/proto --go_out=$(PROTO_OUT) --go_opt=paths=source_relative \
		--go-grpc_out=$(PROTO_OUT) --go-grpc_opt=paths=source_relative \
		api/proto/*.proto

# Regenerates the code into a temp dir and fails if api/proto differs from it
# (fix: make proto). The header line naming protoc's version is ignored, so a
# different protoc patch release does not fail the check.
verify-proto: $(BIN)/protoc-gen-go $(BIN)/protoc-gen-go-grpc
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(MAKE) --no-print-directory proto PROTO_OUT=$$tmp >/dev/null || exit 1; \
	stale=0; \
	for f in "$$tmp"/*.go; do \
		diff -u -I '^//.*protoc  *v[0-9]' "api/proto/$${f##*/}" "$$f" || stale=1; \
	done; \
	for f in api/proto/*.pb.go; do \
		[ -e "$$tmp/$${f##*/}" ] || { echo "$$f: not generated from any .proto"; stale=1; }; \
	done; \
	if [ $$stale = 1 ]; then echo "api/proto is out of date: run make proto"; exit 1; fi; \
	echo "api/proto is up to date"

# The third-party NBD clients that the nbd and "stor-ctl nbd serve" tests drive
# (libnbd's nbdinfo and nbdcopy, qemu-io, fio's nbd engine; nbdkit is the
# benchmark baseline). Those tests skip, saying so, when a client is missing.
NBD_TOOLS ?= libnbd-bin qemu-utils fio nbdkit
SUDO ?= $(if $(filter 0,$(shell id -u)),,sudo)
install-nbd-tools:
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(NBD_TOOLS)

# The NBD server's tests, then stor-ctl nbd serve against a 3-server cluster
# with the third-party clients, verbose.
test-nbd:
	$(GO) test -race -count=1 -v ./nbd/
	$(GO) test -race -count=1 -v -run 'NBD' ./internal/ctl/

# Fuzzes the NBD handshake and request parsers for FUZZTIME each. New inputs
# are minimized for at most 5s (the default 60s would eat a short run). Go
# 1.26's fuzz coordinator can fail a run with a bare "context deadline
# exceeded" at the end of -fuzztime and no crasher written (golang/go#75804,
# fixed in 1.27): only a file in nbd/testdata/fuzz is a finding.
FUZZTIME ?= 20s
fuzz-nbd:
	$(GO) test ./nbd/ -run '^$$' -fuzz '^FuzzHandshake$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 5s
	$(GO) test ./nbd/ -run '^$$' -fuzz '^FuzzRequests$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 5s

# stor-ctl nbd serve (1 and 3 replicas, a 3-server cluster of its own) against
# nbdkit's file plugin, with fio's nbd engine over unix sockets; prints the
# table and writes bench-results/nbd-<time>.{md,json}. About 10 minutes;
# BENCH_RUNS, BENCH_RUNTIME, BENCH_WORKLOADS... shorten it (see the script).
bench-nbd:
	./scripts/bench-nbd.sh

# The VM tests (internal/vmtest): Debian's kernel under qemu with an
# initramfs of the project's static binaries, running the kernel NBD
# scenarios (netlink attach, ext4, a replica killed, restart survival).
# They skip, saying what is missing, without qemu or the kernel (make
# install-vm-tools). VM_RUN selects tests (a -run pattern). KVM only when a
# probe boot shows it works (else TCG, about 15 minutes under load);
# STOR_VM_ACCEL=kvm|tcg forces one.
VM_RUN ?= ^TestVM
vm:
	$(GO) test -count=1 -timeout 30m -v -run '$(VM_RUN)' ./internal/vmtest/

# What the VM tests need: qemu, a busybox for the guest, the ext4 and xfs tools,
# and Debian's kernel (linux-image-amd64) unpacked without installing it
# into the cache dir (internal/vmtest/install-kernel.sh; $$STOR_VM_CACHE, else
# /var/cache/stor-vm for root).
VM_TOOLS ?= qemu-system-x86 busybox-static e2fsprogs xfsprogs
install-vm-tools:
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(VM_TOOLS)
	./internal/vmtest/install-kernel.sh

# The static linux/amd64 binaries the container images copy
# (deploy/images/*/Dockerfile): every command under cmd/ into bin/image/.
IMAGE_BIN ?= $(BIN)/image
IMAGE_GOARCH ?= amd64
image-binaries:
	CGO_ENABLED=0 GOOS=linux GOARCH=$(IMAGE_GOARCH) $(GO) build -trimpath -ldflags '-s -w' -o $(IMAGE_BIN)/ ./cmd/...
	@ls -l $(IMAGE_BIN)

# The container images, tagged as deploy/kubernetes/base/kustomization.yaml
# names them: stor-server:dev and stor-csi:dev (local placeholders; nothing
# publishes them). IMAGE_REPO=registry.example.com/stor/ IMAGE_TAG=v1 tags
# them for a registry instead (then push them and change the kustomization's
# newName/newTag). Needs docker (DOCKER=podman works too).
DOCKER ?= docker
IMAGE_REPO ?=
IMAGE_TAG ?= dev
images: image-binaries
	$(DOCKER) build -f deploy/images/stor-server/Dockerfile -t $(IMAGE_REPO)stor-server:$(IMAGE_TAG) .
	$(DOCKER) build -f deploy/images/stor-csi/Dockerfile -t $(IMAGE_REPO)stor-csi:$(IMAGE_TAG) .

# The manifests under deploy/kubernetes rendered with kustomize and decoded
# strictly into Kubernetes types, with their cross-references checked.
test-deploy:
	$(GO) test -count=1 -v ./deploy/
# The Jepsen-style fault tests (jepsen/, docs/JEPSEN.md): real stor-server
# processes in network namespaces, nemeses, porcupine. Needs root, ip and
# nft (they skip, saying so, otherwise). make jepsen is the CI run: one
# 60 s run with every nemesis, then the proof that the checkers catch a
# deliberately broken engine; about 3 minutes. Reports, histories and logs
# go to JEPSEN_OUT. JEPSEN_SEED=0 picks a seed from the clock (printed);
# JEPSEN_NEMESES is "all", "none" or a comma-separated list; JEPSEN_EXTRA
# more test flags (e.g. -jepsen.cold=-1 -jepsen.fill=-1, docs/JEPSEN.md).
JEPSEN_OUT ?= jepsen-out
JEPSEN_SEED ?= 0
JEPSEN_NEMESES ?= all
JEPSEN_EXTRA ?=
JEPSEN_FLAGS = -jepsen.seed=$(JEPSEN_SEED) -jepsen.nemeses=$(JEPSEN_NEMESES) $(JEPSEN_EXTRA)
# docs/stor-ctl: the stor-ctl reference, generated from the command tree by
# cobra's doc generator (make test fails when it is stale).
docs:
	$(GO) test -count=1 -run '^TestReferenceIsGenerated$$' ./internal/ctl/ -update-reference

# The real control-plane tier: deploy/'s base on kube-apiserver,
# kube-controller-manager, kube-scheduler and etcd (v1.37.2) with the CSI
# sidecars at deploy/'s tags, all built from the tools modules under
# tools/k8s (scripts/k8s-tools.sh; ~15 CPU-minutes cold, cached in
# ~/.cache/stor/k8s), and fake kubelets driving in-process node plugins
# (package internal/k8stest; the kernel path is make vm's).
k8s-tools:
	scripts/k8s-tools.sh

k8s:
	tools=$$(scripts/k8s-tools.sh) && STOR_K8S_TOOLS=$$tools $(GO) test -count=1 -timeout 20m -v -run '^(TestK8s|TestControlPlaneAuthorizes)$$' ./deploy/ ./internal/k8stest/

jepsen:
	JEPSEN=1 JEPSEN_OUT=$(abspath $(JEPSEN_OUT)) $(GO) test -count=1 -timeout 15m -v -run '^TestJepsen' ./jepsen/ \
		-jepsen.duration=60s $(JEPSEN_FLAGS)

# Long runs: RUNS runs of DURATION each (seeds JEPSEN_SEED, +1, ...); the
# table of results is written to JEPSEN_OUT/table.md.
RUNS ?= 20
DURATION ?= 60s
JEPSEN_SOAK_TIMEOUT ?= 4h
jepsen-soak:
	JEPSEN=1 JEPSEN_OUT=$(abspath $(JEPSEN_OUT)) $(GO) test -count=1 -timeout $(JEPSEN_SOAK_TIMEOUT) -v -run '^TestJepsen$$' ./jepsen/ \
		-jepsen.runs=$(RUNS) -jepsen.duration=$(DURATION) $(JEPSEN_FLAGS)

clean:
	rm -rf $(BIN)

# The CSI driver's tests: csi-sanity (mount and block) against an
# in-process 3-server cluster with an injected attacher and mount-utils'
# fake mounter, fencing, restart recovery. Also part of make test.
test-csi:
	$(GO) test -race -count=1 -v -run 'TestSanity|TestPublishFencing|TestNodeRestart' ./csi/

# The CSI VM scenarios only (make vm runs them with the rest): csi-sanity's
# node tests with the real kernel NBD, kubelet's order (ext4 and xfs) with
# an online expansion and a restage, kill -9 of the node plugin under a
# writer, snapshot and clone.
vm-csi:
	$(MAKE) vm VM_RUN='TestVMCSI'

# CreateVolume, CreateSnapshot and ControllerExpandVolume latency through
# the CSI socket on 3 in-process servers, p50/p99, beside the direct
# cluster calls (docs/BENCHMARKS.md). STOR_CSI_BENCH_N calls each.
bench-csi:
	STOR_CSI_BENCH=1 $(GO) test -count=1 -v -run TestCSILatency ./csi/
