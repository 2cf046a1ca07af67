package server

import (
	"log/slog"

	"github.com/stor-io/stor/replica"
)

// jepsenReplicaFS, when set, supplies the replica store's filesystem of a
// server whose Config leaves ReplicaFS nil. Only jepsenfaults.go sets it,
// and that file is compiled only with the jepsenfaults build tag (the
// jepsen harness's stor-server), so no release build can inject faults.
var jepsenReplicaFS func(*slog.Logger) replica.FS
