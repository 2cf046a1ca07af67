package servertest

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// pair is a network with node 1 listening and a connection node 0 dialed
// to it (c) and its accepted end (peer); all closed in t.Cleanup.
func pair(t *testing.T) (n *Network, ln net.Listener, c, peer net.Conn) {
	t.Helper()
	n = NewNetwork()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	n.Register(ln.Addr().String(), 1)
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	c, err = n.Dialer(0)(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	peer = <-accepted
	t.Cleanup(func() { peer.Close() })
	return n, ln, c, peer
}

// A stalled pair passes nothing and closes nothing: a read waits (and
// keeps what arrived) until its deadline or a Heal, a write waits for
// its deadline, and a Heal lets what was held through.
func TestStallHoldsConnectionsOpenUntilHeal(t *testing.T) {
	n, ln, c, peer := pair(t)

	n.Stall(0, 1)
	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if _, err := c.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a read across a stall, with a deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := c.Write([]byte("y")); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a write across a stall, with a deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	c.SetDeadline(time.Time{})
	dctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := n.Dialer(0)(dctx, "tcp", ln.Addr().String()); err == nil {
		t.Fatal("a dial across a stall succeeded")
	}

	read := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(c, buf)
		read <- err
	}()
	select {
	case err := <-read:
		t.Fatalf("a read across a stall returned (%v) before the Heal", err)
	case <-time.After(200 * time.Millisecond):
	}
	n.Heal()
	select {
	case err := <-read:
		if err != nil || buf[0] != 'x' {
			t.Fatalf("after the Heal the read returned %q, %v; want what the peer wrote", buf, err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the read did not return after the Heal")
	}
}

// A read already waiting on its socket when the stall begins keeps what
// then arrives until the Heal; a deadline set while a read waits across a
// stall ends it, as a net.Conn's does.
func TestStallHoldsWhatAWaitingReadGets(t *testing.T) {
	n, _, c, peer := pair(t)

	buf := make([]byte, 1)
	read := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(c, buf)
		read <- err
	}()
	time.Sleep(100 * time.Millisecond) // the read waits on its socket
	n.Stall(0, 1)
	if _, err := peer.Write([]byte("z")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-read:
		t.Fatalf("a read across a stall returned (%q, %v) before the Heal", buf, err)
	case <-time.After(300 * time.Millisecond):
	}
	n.Heal()
	select {
	case err := <-read:
		if err != nil || buf[0] != 'z' {
			t.Fatalf("after the Heal the read returned %q, %v; want what the peer wrote", buf, err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the read did not return after the Heal")
	}

	n.Stall(0, 1)
	defer n.Heal()
	go func() {
		_, err := c.Read(buf)
		read <- err
	}()
	time.Sleep(100 * time.Millisecond)
	c.SetReadDeadline(time.Now())
	select {
	case err := <-read:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a stalled read after its deadline was set to now: %v, want os.ErrDeadlineExceeded", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a deadline set while a read waited across a stall did not end it")
	}
}

// StallPort stalls only the connections to one listener: another listener
// of the same node still passes traffic, and after a Heal the stalled
// port's read gets what the peer wrote meanwhile.
func TestStallPortStallsOnlyThatPort(t *testing.T) {
	n, _, c, peer := pair(t)
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	n.Register(other.Addr().String(), 1)
	go func() {
		oc, err := other.Accept()
		if err == nil {
			defer oc.Close()
			io.Copy(oc, oc) // echo
		}
	}()
	oc, err := n.Dialer(0)(context.Background(), "tcp", other.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer oc.Close()

	n.StallPort(0, c.(*conn).addr)
	if _, err := peer.Write([]byte("s")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if _, err := c.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a read from a stalled port, with a deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	oc.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := oc.Write([]byte("o")); err != nil {
		t.Fatalf("a write to the node's other port: %v", err)
	}
	if _, err := io.ReadFull(oc, buf); err != nil || buf[0] != 'o' {
		t.Fatalf("the node's other port, while one of its ports stalls: %q, %v; want its echo", buf, err)
	}

	n.Heal()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, buf); err != nil || buf[0] != 's' {
		t.Fatalf("after the Heal the stalled port's read returned %q, %v; want what the peer wrote", buf, err)
	}
}

// A dial to a stopped node's address is refused without reaching it:
// what listens there now (another test binary's server, which took the
// port the node released) hears nothing from this cluster. Started
// again, the node is dialed as before.
func TestAStoppedNodeIsNotDialed(t *testing.T) {
	n := NewNetwork()
	other, err := net.Listen("tcp", "127.0.0.1:0") // the port's new owner
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	n.Register(other.Addr().String(), 1)
	heard := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := other.Accept()
			if err != nil {
				return
			}
			heard <- c
		}
	}()
	n.SetStopped(1, true)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if c, err := n.Dialer(0)(ctx, "tcp", other.Addr().String()); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial to a stopped node: %v, %v; want ECONNREFUSED", c, err)
	}
	select {
	case c := <-heard:
		c.Close()
		t.Fatal("the listener on a stopped node's address was dialed")
	case <-time.After(200 * time.Millisecond):
	}
	n.SetStopped(1, false)
	c, err := n.Dialer(0)(ctx, "tcp", other.Addr().String())
	if err != nil {
		t.Fatalf("dial to the node started again: %v", err)
	}
	c.Close()
	select {
	case c := <-heard:
		c.Close()
	case <-ctx.Done():
		t.Fatal("the node started again was not dialed")
	}
}
