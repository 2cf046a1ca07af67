package nbd

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// errAbort ends a connection cleanly: the client sent NBD_OPT_ABORT.
var errAbort = errors.New("nbd: client aborted the handshake")

// conn is one client connection: the handshake, then transmission.
type conn struct {
	s  *Server
	nc net.Conn
	br *bufio.Reader
	bw *bufio.Writer

	noZeroes bool // the client sent NBD_FLAG_C_NO_ZEROES
	accepted bool // from Serve: counted in MaxConns, frame and idle timeouts apply

	// mu orders drain against the deadline changes of the handshake, so a
	// drain is never undone by clearing the handshake deadline.
	mu       sync.Mutex
	draining bool
}

func newConn(s *Server, nc net.Conn) *conn {
	return &conn{s: s, nc: nc, br: bufio.NewReaderSize(nc, 64<<10), bw: bufio.NewWriterSize(nc, 64<<10)}
}

// drain makes the connection stop reading: a read in progress fails at
// once, and the reader treats that as the end of the stream.
func (c *conn) drain() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.draining = true
	c.nc.SetReadDeadline(time.Now())
}

// setReadDeadline sets the read deadline unless the connection is
// draining (whose deadline in the past must stay).
func (c *conn) setReadDeadline(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.draining {
		c.nc.SetReadDeadline(t)
	}
}

func (c *conn) isDraining() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.draining
}

// serve runs the connection to its end and closes it.
func (c *conn) serve() error {
	defer c.nc.Close()
	log := c.s.logger.With("remote", remote(c.nc))
	exp, err := c.handshake()
	switch {
	case errors.Is(err, errAbort):
		return nil
	case err != nil && c.isDraining():
		return nil // shut down during the handshake
	case err != nil:
		if errors.Is(err, io.EOF) {
			return nil // the client hung up (a probe, or nbdinfo --list)
		}
		return err
	}
	log = log.With("export", exp.Name)
	log.Info("nbd: client connected")
	err = c.transmit(exp, log)
	log.Debug("nbd: client connection ended", "err", err)
	return err
}

// handshake runs fixed newstyle negotiation until the client chooses an
// export (NBD_OPT_GO or NBD_OPT_EXPORT_NAME), aborts, or breaks the
// protocol. It returns the export to serve.
func (c *conn) handshake() (*Export, error) {
	c.mu.Lock()
	if c.draining {
		c.mu.Unlock()
		return nil, ErrServerClosed
	}
	c.nc.SetDeadline(time.Now().Add(c.s.cfg.HandshakeTimeout))
	c.mu.Unlock()

	var hello [18]byte
	binary.BigEndian.PutUint64(hello[0:], magicInit)
	binary.BigEndian.PutUint64(hello[8:], magicOption)
	binary.BigEndian.PutUint16(hello[16:], flagFixedNewstyle|flagNoZeroes)
	c.bw.Write(hello[:])
	if err := c.bw.Flush(); err != nil {
		return nil, err
	}
	var b4 [4]byte
	if _, err := io.ReadFull(c.br, b4[:]); err != nil {
		return nil, err
	}
	cflags := binary.BigEndian.Uint32(b4[:])
	if cflags&^clientFlagsKnown != 0 {
		return nil, fmt.Errorf("%w: unknown client flags %#x", ErrProtocol, cflags)
	}
	c.noZeroes = cflags&clientFlagNoZeroes != 0

	for range maxOptions {
		exp, err := c.option()
		if err != nil || exp != nil {
			if exp != nil {
				err = c.enterTransmission()
			}
			return exp, err
		}
	}
	return nil, fmt.Errorf("%w: more than %d options", ErrProtocol, maxOptions)
}

// enterTransmission clears the handshake deadline unless the connection
// is draining.
func (c *conn) enterTransmission() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.draining {
		return ErrServerClosed
	}
	return c.nc.SetDeadline(time.Time{})
}

// option reads and answers one option. It returns the chosen export when
// the option ends the handshake successfully.
func (c *conn) option() (*Export, error) {
	var hdr [optionHeaderLen]byte
	if _, err := io.ReadFull(c.br, hdr[:]); err != nil {
		return nil, err
	}
	if m := binary.BigEndian.Uint64(hdr[0:]); m != magicOption {
		return nil, fmt.Errorf("%w: bad option magic %#x", ErrProtocol, m)
	}
	opt := binary.BigEndian.Uint32(hdr[8:])
	n := binary.BigEndian.Uint32(hdr[12:])
	if n > maxOptionLen {
		if _, err := io.CopyN(io.Discard, c.br, int64(n)); err != nil {
			return nil, err
		}
		if opt == optExportName {
			// No error reply is possible: the session must end.
			return nil, fmt.Errorf("%w: NBD_OPT_EXPORT_NAME of %d bytes", ErrProtocol, n)
		}
		return nil, c.reply(opt, repErrTooBig, fmt.Appendf(nil, "option of %d bytes is larger than %d", n, maxOptionLen))
	}
	data := make([]byte, n)
	if _, err := io.ReadFull(c.br, data); err != nil {
		return nil, err
	}

	switch opt {
	case optExportName:
		exp := c.s.lookup(string(data))
		if exp == nil {
			// No error reply is possible: the session must end.
			return nil, fmt.Errorf("nbd: client asked for unknown export %q", data)
		}
		var b [10 + 124]byte
		binary.BigEndian.PutUint64(b[0:], exp.Device.Size())
		binary.BigEndian.PutUint16(b[8:], exp.transmissionFlags())
		out := b[:]
		if c.noZeroes {
			out = b[:10]
		}
		c.bw.Write(out)
		return exp, c.bw.Flush()

	case optAbort:
		c.reply(opt, repAck, nil) // the client may already be gone
		return nil, errAbort

	case optList:
		if n != 0 {
			return nil, c.reply(opt, repErrInvalid, []byte("NBD_OPT_LIST carries no data"))
		}
		for _, name := range c.s.names {
			e := c.s.exports[name]
			d := binary.BigEndian.AppendUint32(nil, uint32(len(e.Name)))
			d = append(d, e.Name...)
			d = append(d, e.Description...)
			if err := c.write(opt, repServer, d); err != nil {
				return nil, err
			}
		}
		return nil, c.reply(opt, repAck, nil)

	case optInfo, optGo:
		return c.infoOrGo(opt, data)

	case optStartTLS:
		return nil, c.reply(opt, repErrUnsup, []byte("TLS is not supported"))
	case optStructuredReply:
		return nil, c.reply(opt, repErrUnsup, []byte("structured replies are not supported"))
	case optListMetaContext, optSetMetaContext:
		return nil, c.reply(opt, repErrUnsup, []byte("metadata contexts are not supported"))
	case optExtendedHeaders:
		return nil, c.reply(opt, repErrUnsup, []byte("extended headers are not supported"))
	}
	return nil, c.reply(opt, repErrUnsup, fmt.Appendf(nil, "option %d is not supported", opt))
}

// infoOrGo answers NBD_OPT_INFO and NBD_OPT_GO:
//
//	32 bits name length, name, 16 bits count, count x 16 bits info type
func (c *conn) infoOrGo(opt uint32, data []byte) (*Export, error) {
	if len(data) < 6 {
		return nil, c.reply(opt, repErrInvalid, []byte("option too short"))
	}
	nameLen := binary.BigEndian.Uint32(data)
	if uint64(nameLen) > uint64(len(data))-6 {
		return nil, c.reply(opt, repErrInvalid, []byte("export name length exceeds the option"))
	}
	name := string(data[4 : 4+nameLen])
	rest := data[4+nameLen:]
	count := int(binary.BigEndian.Uint16(rest))
	rest = rest[2:]
	if len(rest) != 2*count {
		return nil, c.reply(opt, repErrInvalid, []byte("information request count does not match the option length"))
	}
	var wantName, wantDescription bool
	for i := range count {
		switch binary.BigEndian.Uint16(rest[2*i:]) {
		case infoName:
			wantName = true
		case infoDescription:
			wantDescription = true
		}
	}
	exp := c.s.lookup(name)
	if exp == nil {
		return nil, c.reply(opt, repErrUnknown, fmt.Appendf(nil, "no export named %q", name))
	}

	// NBD_INFO_EXPORT is mandatory. NBD_INFO_BLOCK_SIZE is sent whether
	// or not it was asked for (the protocol allows that); a client that
	// did not ask may still send misaligned requests, which get EINVAL.
	info := binary.BigEndian.AppendUint16(nil, infoExport)
	info = binary.BigEndian.AppendUint64(info, exp.Device.Size())
	info = binary.BigEndian.AppendUint16(info, exp.transmissionFlags())
	if err := c.write(opt, repInfo, info); err != nil {
		return nil, err
	}
	info = binary.BigEndian.AppendUint16(info[:0], infoBlockSize)
	info = binary.BigEndian.AppendUint32(info, exp.MinBlockSize)
	info = binary.BigEndian.AppendUint32(info, max(4096, exp.MinBlockSize))
	info = binary.BigEndian.AppendUint32(info, c.s.cfg.MaxPayload)
	if err := c.write(opt, repInfo, info); err != nil {
		return nil, err
	}
	if wantName {
		info = binary.BigEndian.AppendUint16(info[:0], infoName)
		info = append(info, exp.Name...)
		if err := c.write(opt, repInfo, info); err != nil {
			return nil, err
		}
	}
	if wantDescription && exp.Description != "" {
		info = binary.BigEndian.AppendUint16(info[:0], infoDescription)
		info = append(info, exp.Description...)
		if err := c.write(opt, repInfo, info); err != nil {
			return nil, err
		}
	}
	if err := c.reply(opt, repAck, nil); err != nil {
		return nil, err
	}
	if opt == optGo {
		return exp, nil
	}
	return nil, nil
}

// write buffers one option reply.
func (c *conn) write(opt, typ uint32, data []byte) error {
	var hdr [optReplyHdrLen]byte
	binary.BigEndian.PutUint64(hdr[0:], magicOptionReply)
	binary.BigEndian.PutUint32(hdr[8:], opt)
	binary.BigEndian.PutUint32(hdr[12:], typ)
	binary.BigEndian.PutUint32(hdr[16:], uint32(len(data)))
	c.bw.Write(hdr[:])
	_, err := c.bw.Write(data)
	return err
}

// reply writes the final reply to an option and flushes.
func (c *conn) reply(opt, typ uint32, data []byte) error {
	if err := c.write(opt, typ, data); err != nil {
		return err
	}
	return c.bw.Flush()
}

// transmissionFlags are the flags advertised for the export.
func (e *Export) transmissionFlags() uint16 {
	f := tflagHasFlags | tflagSendFlush | tflagCanMultiConn
	if e.ReadOnly {
		return f | tflagReadOnly
	}
	return f | tflagSendFUA | tflagSendTrim | tflagSendWriteZeroes
}
