package server

import (
	"log/slog"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// jepsenReplicaFS, when set, supplies the replica store's filesystem of a
// server whose Config leaves ReplicaFS nil. Only jepsenfaults.go sets it,
// and that file is compiled only with the jepsenfaults build tag (the
// jepsen harness's stor-server), so no release build can inject faults.
var jepsenReplicaFS func(*slog.Logger) replica.FS

// jepsenDataConfig, when set, adjusts the replica data service's
// configuration (a broken mode's knob); set only by jepsenfaults.go.
var jepsenDataConfig func(*wire.ServerConfig)

// jepsenIgnoreDataDir, when set, makes the server ignore data dir
// identity, as before it existed: it registers without its dir's name and
// makes every replica placed on it whatever its record says (the broken
// mode "admit-new-data-dirs"); set only by jepsenfaults.go.
var jepsenIgnoreDataDir bool
