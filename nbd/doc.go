// Package nbd serves block devices over the Network Block Device protocol
// (NetworkBlockDevice/nbd doc/proto.md). It is stor's own server:
// github.com/pojntfx/go-nbd was rejected (DESIGN.md, "NBD") because it
// serves one request at a time, has no FLUSH/FUA/TRIM/WRITE_ZEROES, and
// turns device errors into dropped connections.
//
// A Server serves Exports, each a Device (*engine.Engine is one), over any
// net.Listener (TCP, unix sockets: Serve) or an already-connected net.Conn
// (the socket pairs handed to the kernel: ServeConn).
//
// # Handshake
//
// Fixed newstyle only (the server sets NBD_FLAG_FIXED_NEWSTYLE and
// NBD_FLAG_NO_ZEROES; a client that does not set
// NBD_FLAG_C_FIXED_NEWSTYLE still gets fixed-newstyle replies, which the
// protocol allows). Options:
//
//   - NBD_OPT_GO, NBD_OPT_INFO: NBD_INFO_EXPORT (size and transmission
//     flags) and NBD_INFO_BLOCK_SIZE (minimum: the export's MinBlockSize,
//     512 by default; preferred 4096; maximum: Config.MaxPayload, 32 MiB by
//     default) always, NBD_INFO_NAME and NBD_INFO_DESCRIPTION when asked
//     for; NBD_REP_ERR_UNKNOWN for an unknown export, NBD_REP_ERR_INVALID
//     for a malformed option.
//   - NBD_OPT_EXPORT_NAME: the old way in; an unknown name ends the session
//     (the option has no error reply).
//   - NBD_OPT_LIST: one NBD_REP_SERVER per export (name and description).
//   - NBD_OPT_ABORT: NBD_REP_ACK, then the connection closes.
//   - Everything else, including NBD_OPT_STRUCTURED_REPLY, NBD_OPT_STARTTLS
//     and the metadata-context options: NBD_REP_ERR_UNSUP. Replies are
//     always simple replies.
//
// The empty export name selects Config.DefaultExport (the only export,
// when there is one). Transmission flags: HAS_FLAGS, SEND_FLUSH,
// CAN_MULTI_CONN, and either READ_ONLY or SEND_FUA, SEND_TRIM,
// SEND_WRITE_ZEROES.
//
// Limits that keep a hostile or broken client from exhausting the server:
// the handshake must finish within Config.HandshakeTimeout and 1024
// options; an option's payload is read into memory only up to 16 KiB
// (larger ones are skipped and answered NBD_REP_ERR_TOO_BIG); export names
// and descriptions are at most 4096 bytes.
//
// # Transmission
//
// One goroutine per connection reads requests. Each request then runs in
// its own goroutine, so a slow read does not hold up the requests behind
// it; at most Config.MaxInFlight requests and Config.MaxInFlightBytes of
// READ/WRITE payload are in flight per connection (the reader waits when
// either is exhausted, which pushes back on the client). Each request's
// goroutine writes its own reply, in the order requests complete: replies
// that complete together are queued and written by one of them in one
// writev, with no writer goroutine to hand them to (one wake-up less per
// request). A connection's memory is thus
// bounded by MaxInFlightBytes plus fixed buffers, whatever the client
// declares.
//
// Bounds across connections: every READ and WRITE buffer is charged to
// Config.MaxMemory, shared by all connections (a connection that needs
// more waits for others to release theirs). A WRITE of more than 256 KiB
// from a client of Serve is received in 256 KiB chunks and its whole
// buffer taken only once half of it has arrived, so a client that
// announces a large write and stalls holds what it sent, not what it
// announced. (On a socket pair the peer is the kernel, which sends whole
// requests: its payloads go straight into their buffers, with no copy.) Connections from Serve
// (network and unix listeners) are counted against Config.MaxConns (one
// beyond it is closed on accept), must send each request whole within
// Config.FrameTimeout of its first byte (a wait for memory has a
// FrameTimeout of its own, after which the connection is dropped with
// ErrServerBusy), and, if Config.IdleTimeout is set, are closed when idle
// that long. Socket pairs (ServeConn, ServeTransmission) are the kernel's:
// not counted, never timed out.
//
// Commands: READ, WRITE (NBD_CMD_FLAG_FUA makes it durable before the
// reply), FLUSH, TRIM (with FUA: trim, then flush), WRITE_ZEROES (holes
// unless NBD_CMD_FLAG_NO_HOLE, which writes real zeroes; FUA honoured),
// DISC. The server checks each request before the device sees it and
// answers, never disconnecting, with:
//
//   - EINVAL: an unknown or unoffered command (CACHE, BLOCK_STATUS, ...),
//     a flag not valid for the command, an offset or length not a
//     multiple of the minimum block size, a READ or TRIM past the end, a
//     READ or WRITE larger than MaxPayload. (The protocol asks for EINVAL,
//     not ENOTSUP, for unknown commands: ENOTSUP is reserved for
//     NBD_CMD_FLAG_FAST_ZERO, which is not offered.)
//   - ENOSPC: a WRITE or WRITE_ZEROES past the end (the protocol's choice).
//   - EPERM: WRITE, WRITE_ZEROES or TRIM on a read-only export.
//
// A WRITE larger than MaxPayload has its payload read and discarded
// (without being held in memory) before the EINVAL reply, so the stream
// stays in step; the protocol allows a hard disconnect instead, which
// would turn one bad request into the loss of every request in flight.
// Device errors are mapped to NBD errors by one table (errors.go): EINVAL
// for replica.ErrInvalid, ENOSPC for replica.ErrNoSpace, ESHUTDOWN for a
// closing engine, and EIO for everything else, engine.ErrFenced and
// engine.ErrIO included. A Device may return an Errno to choose the value
// itself. Device errors other than EINVAL are logged (at most one line a
// second per server).
//
// Only a broken stream ends a connection: a bad request magic, a read or
// write error on the socket. Then, as after NBD_CMD_DISC, the server stops
// reading, lets the requests in flight finish and their replies go out,
// and closes the connection.
//
// # Multiple connections and flush
//
// CAN_MULTI_CONN promises that a FLUSH on any connection makes durable
// every write acknowledged on any connection, and that a reply to a write
// on one connection makes it visible to reads on all. The server keeps no
// cache: every connection calls the same Device, so the promise is the
// Device's. The volume engine keeps it: a write is acknowledged only after
// every replica in its write set applied it (DESIGN.md, the ack rule), a
// read is served by a healthy replica (which therefore holds every
// acknowledged write), and engine.Flush sends a flush to every replica in
// the write set, each of which makes durable every write it completed. A
// flush therefore covers every write the engine acknowledged before it,
// whichever connection the write came in on; connections are not tracked
// at all.
//
// Replays: after a reconnect the kernel resends requests that were in
// flight. Every command is idempotent on the device (a write of the same
// bytes to the same place, zeroes, a trim, a flush), so a replayed request
// is harmless, whether or not its first copy was applied.
//
// # Shutdown
//
// Shutdown stops accepting, stops reading on every connection (a read
// deadline in the past interrupts the reader; a request only partly read
// is dropped unanswered, so the client never takes it as done), waits for
// the requests in flight to be answered, and closes the connections.
// Close does the same without waiting: device calls see their context
// cancelled. Device calls do not end when a client disconnects: a write
// the engine has begun is allowed to finish on every replica rather than
// be cut off half-applied.
//
// # Concurrency
//
// All Server methods are safe for concurrent use. Device methods are
// called concurrently from every connection.
package nbd
