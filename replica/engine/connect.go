package engine

import (
	"context"
	"errors"
	"time"

	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// WireConnector opens replicas over the replica data protocol, one
// connection per replica (each connection pipelines every request the
// engine sends that replica). A replica its server has not created yet
// (the server creates replicas when it applies the volume's creation) is
// retried until ctx ends.
func WireConnector(cfg wire.ClientConfig) Connector {
	return func(ctx context.Context, addr string, open wire.OpenRequest) (ReplicaConn, error) {
		backoff := 20 * time.Millisecond
		for {
			c, err := wire.Dial(ctx, "tcp", addr, cfg)
			if err != nil {
				return nil, err
			}
			h, err := c.OpenFor(ctx, open)
			if err == nil {
				return wireConn{Handle: h, conn: c}, nil
			}
			c.Close()
			if !errors.Is(err, replica.ErrNotFound) {
				return nil, err
			}
			select {
			case <-ctx.Done():
				return nil, err
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 500*time.Millisecond)
		}
	}
}

type wireConn struct {
	*wire.Handle
	conn *wire.Conn
}

func (w wireConn) Close(ctx context.Context) error {
	return errors.Join(w.Handle.Close(ctx), w.conn.Close())
}
