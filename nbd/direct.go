package nbd

import (
	"context"
	"errors"
	"fmt"
	"net"
)

// ErrUnknownExport: ExportInfo or ServeTransmission was given a name that
// is not an export of the server.
var ErrUnknownExport = errors.New("nbd: no such export")

// ExportInfo is what a client learns about an export in the handshake.
// A client that skips the handshake — the Linux kernel, handed a socket by
// netlink (package nbd/kernel) — must be told these values another way.
type ExportInfo struct {
	// Name of the export.
	Name string
	// Size in bytes, as the device reports it now.
	Size uint64
	// Flags are the transmission flags the handshake advertises
	// (NBD_FLAG_HAS_FLAGS, SEND_FLUSH, CAN_MULTI_CONN, and READ_ONLY or
	// SEND_FUA|SEND_TRIM|SEND_WRITE_ZEROES), in the protocol's bit layout,
	// which is also linux/nbd.h's.
	Flags uint16
	// MinBlockSize, PreferredBlockSize and MaxPayload are the block size
	// constraints of NBD_INFO_BLOCK_SIZE.
	MinBlockSize, PreferredBlockSize, MaxPayload uint32
}

// ExportInfo returns what the handshake would tell a client about the
// named export ("" is the default export).
func (s *Server) ExportInfo(name string) (ExportInfo, error) {
	e := s.lookup(name)
	if e == nil {
		return ExportInfo{}, fmt.Errorf("%w: %q", ErrUnknownExport, name)
	}
	return ExportInfo{
		Name:               e.Name,
		Size:               e.Device.Size(),
		Flags:              e.transmissionFlags(),
		MinBlockSize:       e.MinBlockSize,
		PreferredBlockSize: max(4096, e.MinBlockSize),
		MaxPayload:         s.cfg.MaxPayload,
	}, nil
}

// ServeTransmission serves one already-connected client that starts in the
// transmission phase, with no handshake: the server sends nothing first
// and reads requests for the named export at once. This is how the Linux
// kernel speaks on the sockets it is given by netlink (NBD_CMD_CONNECT,
// NBD_CMD_RECONFIGURE): the handshake is the userspace client's job, and
// the kernel learns the size and flags from the netlink message (see
// ExportInfo).
//
// Everything else is as for ServeConn: requests are served concurrently,
// replies go out in completion order; it returns when the connection ends
// (nil after NBD_CMD_DISC, the client closing between requests, or ctx
// ending); when ctx ends the connection is drained as by Shutdown (no new
// requests are read, a request only partly read is dropped unanswered,
// requests in flight are answered) and closed. It closes nc. An unknown
// export is ErrUnknownExport (nc is closed unread).
func (s *Server) ServeTransmission(ctx context.Context, nc net.Conn, export string) error {
	exp := s.lookup(export)
	if exp == nil {
		nc.Close()
		return fmt.Errorf("%w: %q", ErrUnknownExport, export)
	}
	c, ok := s.track(nc, false)
	if !ok {
		nc.Close()
		return ErrServerClosed
	}
	defer s.untrack(c)
	defer nc.Close()
	stop := context.AfterFunc(ctx, c.drain)
	defer stop()
	log := s.logger.With("remote", remote(nc), "export", exp.Name)
	log.Debug("nbd: serving transmission without a handshake")
	err := c.transmit(exp, log)
	log.Debug("nbd: connection ended", "err", err)
	return err
}
