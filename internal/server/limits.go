package server

import (
	"log/slog"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/stor-io/stor/replica/wire"
)

// apiLimits turns APILimits into gRPC server options. The connection cap
// is the listener's (netutil.LimitListener in Start).
func apiLimits(l APILimits) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxConcurrentStreams(l.MaxConcurrentStreams),
		grpc.MaxRecvMsgSize(l.MaxRecvMsgSize),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             l.KeepaliveMinTime,
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			MaxConnectionIdle: l.MaxConnectionIdle,
		}),
		grpc.ConnectionTimeout(l.ConnectionTimeout),
	}
}

// dataConfig is the replica data service's configuration: cfg with the
// server's logger.
func dataConfig(cfg wire.ServerConfig, logger *slog.Logger) wire.ServerConfig {
	cfg.Logger = logger
	return cfg
}
