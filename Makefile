# stor — make targets a newcomer guesses.
GO ?= go
BIN ?= bin
PROTOC_GEN_GO_VERSION ?= v1.36.12
PROTOC_GEN_GO_GRPC_VERSION ?= v1.6.0

.PHONY: build test test-short lint proto verify-proto cluster bench clean

build:
	CGO_ENABLED=0 $(GO) build -o $(BIN)/ ./cmd/...

test:
	$(GO) test -race -count=1 -timeout 25m ./...

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

$(BIN)/protoc-gen-go:
	GOBIN=$(abspath $(BIN)) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)

$(BIN)/protoc-gen-go-grpc:
	GOBIN=$(abspath $(BIN)) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)

# protoc comes from Debian's protobuf-compiler (apt-get install protobuf-compiler).
proto: $(BIN)/protoc-gen-go $(BIN)/protoc-gen-go-grpc
	protoc --plugin=protoc-gen-go=$(BIN)/protoc-gen-go --plugin=protoc-gen-go-grpc=$(BIN)/protoc-gen-go-grpc \
		-I api/proto --go_out=api/proto --go_opt=paths=source_relative \
		--go-grpc_out=api/proto --go-grpc_opt=paths=source_relative \
		api/proto/*.proto

clean:
	rm -rf $(BIN)
