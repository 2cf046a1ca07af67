// Package wire is the replica data protocol: a binary, pipelined
// request/reply protocol over one stream connection (TCP or unix), its
// Server (in front of a server's replica store) and its client (Conn and
// Handle, used by the volume engine and the rebuilder).
//
// The volume engine fans every write out to all replicas, so the protocol
// pipelines: a client has many requests in flight on one connection, the
// server serves them concurrently and replies in completion order, and
// each reply names its request by id.
//
// # Frames
//
// All integers are big-endian. Checksums are CRC-32C (Castagnoli). A frame
// is a fixed header followed by PayloadLen bytes of payload.
//
// Request header, 64 bytes:
//
//	off size field
//	  0   4  magic         0x53545251 ("STRQ")
//	  4   1  version       2
//	  5   1  op            opcode, see below; 0 is never valid
//	  6   2  flags         bit 0: FUA; all other bits must be 0
//	  8   8  request id    chosen by the client, echoed in the reply
//	 16   4  handle        from OPEN, per connection; ignored by OPEN and PING (send 0)
//	 20   4  payload len   bytes following the header, <= MaxPayload
//	 24   8  epoch         replica.Op.Epoch (fencing)
//	 32   8  generation    replica.Op.Generation (write history)
//	 40   8  offset        first argument, see the op table
//	 48   8  length        second argument, see the op table
//	 56   4  payload crc   CRC-32C of the payload (0 for none)
//	 60   4  header crc    CRC-32C of bytes 0..59
//
// Reply header, 32 bytes:
//
//	off size field
//	  0   4  magic         0x53545250 ("STRP")
//	  4   1  version       2
//	  5   1  status        0 OK, else an error, see below
//	  6   2  reserved      0
//	  8   8  request id    of the request answered
//	 16   4  payload len   bytes following the header, <= MaxPayload
//	 20   4  payload crc   CRC-32C of the payload (0 for none)
//	 24   4  reserved      0
//	 28   4  header crc    CRC-32C of bytes 0..27
//
// # Operations
//
// An offset or length an op does not use must be 0, and an op that takes
// no payload must carry none (else ErrProtocol). "data" is up to
// replica.MaxIO bytes; "id" is a replica or snapshot id of 1..MaxIDLen
// (256) bytes; offsets and lengths the store takes as int64 must be at
// most MaxInt64 (else replica.ErrInvalid). Epoch and generation travel
// with every op and mean what replica.Op says.
//
//	code op               handle offset          length            request payload  reply payload (OK)
//	   1 OPEN             -      0               0                 open request     handle u32, 0 u32, size u64, epoch u64
//	   2 CLOSE            yes    0               0                 -                -
//	   3 PING             -      0               0                 -                -
//	   4 READ             yes    offset          bytes <= MaxIO    -                data (exactly length bytes)
//	   5 WRITE            yes    offset          bytes <= MaxIO    data (length)    -
//	   6 WRITE_ZEROES     yes    offset          bytes <= 1 GiB    -                -
//	   7 TRIM             yes    offset          bytes <= 1 GiB    -                -
//	   8 FLUSH            yes    0               0                 -                -
//	   9 GROW             yes    0               new size          -                -
//	  10 SNAPSHOT_CREATE  yes    0               0                 snapshot id      -
//	  11 SNAPSHOT_DELETE  yes    0               0                 snapshot id      -
//	  12 SNAPSHOT_READ    yes    offset          bytes <= MaxIO    snapshot id      data (exactly length bytes)
//	  13 EXTENTS          yes    from            limit             snapshot id / ""  extents (at most limit)
//	  14 DIRTY_REGIONS    yes    0               0                 -                extents
//	  15 WRITTEN_SINCE    yes    generation      0                 -                extents
//	  16 REBUILD_BEGIN    yes    0               0                 -                -
//	  17 REBUILD_WRITE    yes    offset          bytes <= MaxIO    data (length)    -
//	  18 REBUILD_END      yes    0               0                 -                -
//	  19 REBUILD_COPY     yes    offset          bytes <= MaxIO    budget, source   -
//	  20 DIGEST           yes    offset          bytes <= MaxIO    -                digests (u64 each)
//
// DIGEST (digest.go) reads the range as READ would and answers a CRC-64
// of each 4096-byte block of it (the last one covers what remains), so
// that replicas are compared without moving their data. A server that
// predates it answers ErrUnknownOp, and the caller copies instead.
//
// REBUILD_COPY (copy.go) has the target's server read a rebuild's chunk
// from the source replica and apply it as REBUILD_WRITE would: its payload
// is a u32 budget in milliseconds then the source replica's id; a source
// it cannot read within the budget is StatusCopySource, and nothing is
// written.
//
// A REBUILD_WRITE or REBUILD_COPY belongs to the rebuild that its
// handle's last REBUILD_BEGIN served so far left in progress when the
// server read it off the connection, and is applied to that rebuild only
// (replica.Replica.RebuildWriteSession): one its rebuilder gave up on, and
// that the server comes to only after the rebuild started over
// (REBUILD_END, REBUILD_BEGIN), writes nothing and fails: a REBUILD_WRITE
// with replica.ErrInvalid, a REBUILD_COPY with replica.ErrInvalid when the
// rebuild had ended before it began, else with whatever the source or the
// target said (StatusCopySource, a stale epoch). On a handle that sent no
// REBUILD_BEGIN it belongs to the rebuild in progress when it is served.
// REBUILD_BEGIN and REBUILD_END are not tied to a session (a new
// rebuilder's first REBUILD_END must end whatever tracking an earlier one
// left). A rebuilder gives up on them only by leaving the connection, so
// one the server comes to after the connection's client closed it, or
// lost it, is refused with replica.ErrClosed: begun or ended this late, it
// could be a later rebuilder's rebuild. A REBUILD_END with FUA also says
// the sender copied every region the replica owes since its server opened
// it (a rebuild that completed, or a reconcile): replica.Replica.EndRebuild
// settles them. A server that predates this ignores the flag.
//
// An extent list is a sequence of 16-byte entries, each offset u64 then
// length u64, at most MaxExtents (524288, 8 MiB) of them. EXTENTS takes a
// limit of 1..MaxExtents and an empty id for the head; it returns
// at most limit, so a caller pages by asking again from the end of the
// last extent. (The store's "limit <= 0: all" is not offered over the
// wire: every reply is bounded.)
//
// An open request (at most MaxOpenPayload bytes) is five fields separated
// by NUL bytes: replica id, purpose ("attach", "rebuild", "snapshot-cut",
// "clone-copy", "inspect" or "rebuild-source"), volume id, node (or server id), snapshot id
// (clone-copy only), each at most MaxIDLen bytes; a payload of the replica
// id alone is an open with no purpose (Conn.Open). A server reading a
// REBUILD_COPY's source opens it with purpose "rebuild-source". The epoch is the
// header's. Version 2 added the fields; version 1's OPEN carried only the
// replica id, and a version 1 frame is refused.
//
// OPEN with a non-zero epoch fences the replica (replica.Replica.Fence)
// before answering; with epoch 0 it opens without fencing. Either way
// every request carries its own epoch and the store refuses stale ones.
// Handles belong to the connection that opened them and die with it. While
// a handle is open, a replica that implements Pinner (the store's does) is
// pinned: the store keeps its files open (replica's doc, "Open files").
//
// # Authorisation
//
// A Server with an Authorizer (ServerConfig.Authorizer; stor-server's is
// internal/server's dataAccess) asks it about every OPEN before the
// replica is looked up or fenced, passing the open request and the Peer:
// its address and the Identity that ServerConfig.Identify read from the
// connection (the TLS layer's job; without it every peer is unverified).
// A refused OPEN fails with ErrDenied (or replica.ErrNotFound,
// replica.ErrStaleEpoch, as the Authorizer says); a granted one keeps the
// Grant with its handle, and every later request on the handle but CLOSE
// is put to Grant.Allow first (op, epoch, generation, GROW's size, the
// snapshot id). A refused request fails with ErrDenied and never reaches
// the replica. Without an Authorizer every OPEN is accepted, as before
// (tests of the protocol and of the engine).
//
// FLUSH covers the writes whose replies the client has received, as a
// disk's flush covers completed writes; requests in flight together are
// unordered.
//
// # Incarnations
//
// An engine that gives a replica up (it stopped answering in time) closes
// its connection and, once the replica is back, opens it again on a new
// one: a new incarnation, at the same epoch. Whatever the old connection
// still carried (TCP delivers what was queued once a partition heals) must
// not land after that: it would overwrite what the new incarnation's
// rebuild and writes put there, and the epoch cannot tell them apart. So
// an attach OPEN (PurposeAttach) states its incarnation
// (OpenRequest.Incarnation, in the header's generation field: the
// replica's control-plane generation when the engine opened it, which
// only grows), and the server orders a replica's attach handles by epoch,
// then incarnation. A request that may change the replica (every op but
// READ, SNAPSHOT_READ, EXTENTS, DIGEST, DIRTY_REGIONS and WRITTEN_SINCE)
// on a handle older than the newest fails and changes nothing:
// replica.ErrStaleEpoch if a newer epoch opened it, else replica.ErrClosed.
// An OPEN of a newer incarnation returns only once every changing request
// of an older one already past that check has finished (those requests
// hold the replica's attachGate shared, the OPEN takes it exclusively, as
// with the epoch). An OPEN of an equal or older incarnation takes nothing
// over: an engine's duplicate OPEN, or one its client gave up on that the
// server reached late. The order lives as long as the server process
// (the connections it orders die with it), or until the replica is
// deleted (Server.Forget). Handles of other purposes
// (rebuild sources, inspection, clone copies, a detached volume's rebuild
// or snapshot cut, which run at epochs of their own) are not ordered. The
// Authorizer checks the incarnation against the metadata: stor-server's
// refuses one above the replica's generation there.
//
// # Status codes
//
// A failed reply carries the server's error text (at most MaxMessage
// bytes) as its payload. Codes 1-9 are replica's sentinels, so a client's
// errors.Is sees the same identity a local caller would; 32 and up are
// the protocol's own.
//
//	code status
//	   0 OK
//	   1 replica.ErrStaleEpoch
//	   2 replica.ErrNotFound
//	   3 replica.ErrExists
//	   4 replica.ErrInvalid
//	   5 replica.ErrIO
//	   6 replica.ErrNoSpace
//	   7 replica.ErrCorrupt
//	   8 replica.ErrHistoryLost
//	   9 replica.ErrClosed
//	  32 ErrBadHandle    the handle is not open on this connection
//	  33 ErrUnknownOp    the opcode is unknown
//	  34 ErrProtocol     a malformed request
//	  35 ErrChecksum     the request payload failed its CRC
//	  36 ErrInternal     an error that maps to none of the above
//	  37 ErrDenied       the Authorizer refused the OPEN or the request
//	  38 ErrCopySource   a REBUILD_COPY could not read its source
//
// # Malformed input
//
// The server never panics on input and never allocates from a length
// field: a payload of more than 256 KiB is received in 256 KiB chunks, and
// its whole buffer is taken only once half of it has arrived, so a peer
// that announces an 8 MiB frame and stalls holds what it sent, not what
// it announced. Per connection it holds at most
// ServerConfig.MaxInFlightBytes of payload (or one request, if that alone
// is larger); all connections together hold at most
// ServerConfig.MaxMemory of payload buffers, request data and reply data
// alike (a connection that needs more waits for others to release
// theirs). A frame must arrive whole within FrameTimeout of its first
// byte; a connection with no replica open and no request in flight that
// sends nothing for IdleTimeout is closed; connections beyond MaxConns
// are closed on accept.
//
//   - Bad magic or header checksum: the stream cannot be trusted; the
//     connection is closed without a reply.
//   - Unsupported version, or a payload length above MaxPayload: the id is
//     trustworthy but the framing is not; an ErrProtocol reply, then close.
//   - Payload checksum mismatch: an ErrChecksum reply; the request is not
//     run; the connection goes on.
//   - Unknown op, unknown flags, fields that must be zero, a payload the op
//     does not take: an ErrUnknownOp or ErrProtocol reply; the connection
//     goes on.
//   - Out-of-range arguments (an I/O above MaxIO, a WRITE_ZEROES or TRIM
//     above replica.MaxZeroes (1 GiB), an offset above
//     MaxInt64, an id too long): a replica.ErrInvalid reply.
//   - An unknown handle: an ErrBadHandle reply.
//
// The client treats a reply it cannot decode the same way: a bad header
// breaks the connection (every call fails with ErrDisconnected); a reply
// whose payload does not fit its request fails only that call.
//
// # Concurrency
//
// Server: per connection, one reader goroutine parses requests and starts
// a goroutine per request, bounded by ServerConfig.MaxInFlight and
// MaxInFlightBytes (the reader stops reading while the budget is spent,
// which pushes back on the client through TCP). Replies go out in
// completion order through a batching writer: a small frame is copied
// into a queue, and the goroutine whose frame lands in an empty queue
// yields once (so that other runnable workers add theirs) and writes the
// whole queue in one system call; a frame with more than 64 KiB of payload
// is written directly (writev). Close waits for every goroutine,
// including requests still inside the store.
//
// Client: a Conn's methods and its Handles' methods may be called from
// many goroutines. Each call registers its request id, writes its frame
// through the same kind of batching writer and waits; one reader
// goroutine reads replies and completes calls, reading READ data straight
// into the caller's buffer. A cancelled context abandons the wait; the
// late reply is dropped. If the reply is already being received into the
// caller's buffer, the call waits for it (at most ClientConfig.Timeout,
// after which the connection is broken).
package wire
