package nbd

import (
	"encoding/binary"
	"strings"
	"testing"
)

func TestHandshakeGoInfo(t *testing.T) {
	dev := newMemDevice(1 << 20)
	s := newTestServer(t, dev, nil)
	nc, _ := pipe(t, s)
	c := newRawClient(t, nc)
	c.greet(clientFlagFixedNewstyle | clientFlagNoZeroes)

	// INFO with every information type asked for, by name.
	c.sendOption(optInfo, goData("mem", infoBlockSize, infoName, infoDescription, 99))
	info, final := c.infoReplies(optInfo)
	if final.typ != repAck {
		t.Fatalf("NBD_OPT_INFO: final reply %#x %q, want ACK", final.typ, final.data)
	}
	want := exportInfo{
		size:  1 << 20,
		flags: tflagHasFlags | tflagSendFlush | tflagSendFUA | tflagSendTrim | tflagSendWriteZeroes | tflagCanMultiConn,
		minBS: 512, prefBS: 4096, maxBS: 32 << 20,
		name: "mem", description: "a memory device",
		hasBlockSize: true, hasName: true,
	}
	if info != want {
		t.Fatalf("NBD_OPT_INFO told\n%+v\nwant\n%+v", info, want)
	}

	// INFO without requests still sends the export and block sizes (the
	// protocol allows unrequested NBD_INFO_BLOCK_SIZE), but no name.
	c.sendOption(optInfo, goData(""))
	info, final = c.infoReplies(optInfo)
	if final.typ != repAck || info.size != 1<<20 || !info.hasBlockSize || info.hasName {
		t.Fatalf("NBD_OPT_INFO of the default export: %+v, final %#x", info, final.typ)
	}

	// Unknown export: ERR_UNKNOWN, and the client may go on.
	c.sendOption(optGo, goData("nope"))
	if _, final = c.infoReplies(optGo); final.typ != repErrUnknown {
		t.Fatalf("NBD_OPT_GO of an unknown export: %#x, want ERR_UNKNOWN", final.typ)
	}

	// Malformed GO payloads: ERR_INVALID.
	for _, bad := range [][]byte{
		{0, 0, 0},                     // too short
		{0, 0, 0, 9, 'm', 0, 0},       // name longer than the option
		append(goData("mem", 1), 0),   // odd trailing byte
		goData("mem", 1, 2)[:4+3+2+2], // count says 2, one present
	} {
		c.sendOption(optGo, bad)
		if _, final = c.infoReplies(optGo); final.typ != repErrInvalid {
			t.Fatalf("NBD_OPT_GO % x: reply %#x, want ERR_INVALID", bad, final.typ)
		}
	}

	// GO enters transmission; the connection then serves requests.
	c.sendOption(optGo, goData("mem", infoBlockSize))
	if _, final = c.infoReplies(optGo); final.typ != repAck {
		t.Fatalf("NBD_OPT_GO: %#x", final.typ)
	}
	if e := c.write(0, pattern(4096, 1), 0); e != 0 {
		t.Fatalf("write after GO: %v", e)
	}
}

func TestHandshakeOptions(t *testing.T) {
	cases := []struct {
		name string
		opt  uint32
		data []byte
		want uint32
	}{
		{"structured replies", optStructuredReply, nil, repErrUnsup},
		{"starttls", optStartTLS, nil, repErrUnsup},
		{"list meta context", optListMetaContext, nil, repErrUnsup},
		{"set meta context", optSetMetaContext, nil, repErrUnsup},
		{"extended headers", optExtendedHeaders, nil, repErrUnsup},
		{"unknown option", 4242, []byte("whatever"), repErrUnsup},
		{"list with data", optList, []byte{1}, repErrInvalid},
		{"oversized option", optInfo, make([]byte, maxOptionLen+1), repErrTooBig},
	}
	s := newTestServer(t, nil, nil)
	nc, _ := pipe(t, s)
	c := newRawClient(t, nc)
	c.greet(clientFlagFixedNewstyle)
	for _, tc := range cases {
		c.sendOption(tc.opt, tc.data)
		r, err := c.readOptReply()
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if r.opt != tc.opt || r.typ != tc.want {
			t.Errorf("%s: reply to %d is %#x, want %#x for %d", tc.name, r.opt, r.typ, tc.want, tc.opt)
		}
	}
	// The connection survived every refusal.
	c.sendOption(optGo, goData("mem"))
	if _, final := c.infoReplies(optGo); final.typ != repAck {
		t.Fatalf("GO after refusals: %#x", final.typ)
	}
}

func TestHandshakeList(t *testing.T) {
	s := newTestServer(t, nil, func(cfg *Config) {
		cfg.Exports = append(cfg.Exports, Export{Name: "b", Device: newMemDevice(4096)}, Export{Name: "a", Device: newMemDevice(4096)})
		cfg.DefaultExport = "mem"
	})
	nc, _ := pipe(t, s)
	c := newRawClient(t, nc)
	c.greet(clientFlagFixedNewstyle)
	c.sendOption(optList, nil)
	var got []string
	for {
		r, err := c.readOptReply()
		if err != nil {
			t.Fatal(err)
		}
		if r.typ == repAck {
			break
		}
		if r.typ != repServer {
			t.Fatalf("LIST reply type %#x", r.typ)
		}
		n := binary.BigEndian.Uint32(r.data)
		got = append(got, string(r.data[4:4+n])+"|"+string(r.data[4+n:]))
	}
	if want := "a||b||mem|a memory device"; strings.Join(got, "|") != want {
		t.Fatalf("LIST: %q, want %q", strings.Join(got, "|"), want)
	}
	c.sendOption(optAbort, nil)
	if r, err := c.readOptReply(); err != nil || r.typ != repAck {
		t.Fatalf("ABORT: %+v %v, want ACK", r, err)
	}
	c.expectEOF()
}

func TestHandshakeExportName(t *testing.T) {
	for _, noZeroes := range []bool{false, true} {
		s := newTestServer(t, nil, nil)
		nc, _ := pipe(t, s)
		c := newRawClient(t, nc)
		flags := clientFlagFixedNewstyle
		if noZeroes {
			flags |= clientFlagNoZeroes
		}
		c.greet(flags)
		c.sendOption(optExportName, []byte("mem"))
		n := 10
		if !noZeroes {
			n += 124
		}
		b, err := c.readFull(n)
		if err != nil {
			t.Fatal(err)
		}
		if size := binary.BigEndian.Uint64(b); size != 1<<20 {
			t.Fatalf("EXPORT_NAME size %d", size)
		}
		if f := binary.BigEndian.Uint16(b[8:]); f&tflagCanMultiConn == 0 {
			t.Fatalf("EXPORT_NAME flags %#x", f)
		}
		for _, z := range b[10:] {
			if z != 0 {
				t.Fatalf("padding not zero: % x", b[10:])
			}
		}
		// Transmission follows directly.
		if e := c.write(512, pattern(512, 3), 0); e != 0 {
			t.Fatalf("write after EXPORT_NAME (noZeroes=%v): %v", noZeroes, e)
		}
	}
}

// Violations that leave no way to answer end the session.
func TestHandshakeHardDisconnect(t *testing.T) {
	cases := []struct {
		name string
		run  func(c *rawClient)
	}{
		{"unknown client flags", func(c *rawClient) { c.greet(1 << 7) }},
		{"unknown export by EXPORT_NAME", func(c *rawClient) {
			c.greet(clientFlagFixedNewstyle)
			c.sendOption(optExportName, []byte("nope"))
		}},
		{"bad option magic", func(c *rawClient) {
			c.greet(clientFlagFixedNewstyle)
			c.nc.Write(make([]byte, 16))
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestServer(t, nil, nil)
			nc, done := pipe(t, s)
			c := newRawClient(t, nc)
			tc.run(c)
			c.expectEOF()
			if err := <-done; err == nil {
				t.Fatal("ServeConn returned nil for a protocol violation")
			}
		})
	}
}

func TestHandshakeNoDefaultExport(t *testing.T) {
	s := newTestServer(t, nil, func(cfg *Config) {
		cfg.Exports = append(cfg.Exports, Export{Name: "other", Device: newMemDevice(4096)})
	})
	nc, _ := pipe(t, s)
	c := newRawClient(t, nc)
	c.greet(clientFlagFixedNewstyle)
	c.sendOption(optGo, goData(""))
	if _, final := c.infoReplies(optGo); final.typ != repErrUnknown {
		t.Fatalf("GO of the empty name with two exports and no default: %#x, want ERR_UNKNOWN", final.typ)
	}
}
