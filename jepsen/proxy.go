package jepsen

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The link proxy: a userspace TCP proxy that sits in front of a
// stor-server's Raft and data ports (the server advertises the proxy's
// ports), so that links can be made slow or lossy without netem, which
// this kernel lacks. It runs as its own process in the server's network
// namespace (RunProxy) and takes commands on stdin, one per line:
//
//	delay MS JITTER_MS   every chunk forwarded waits MS plus up to JITTER_MS
//	reset P              each chunk forwarded cuts its connection with probability P
//	cut                  cuts every connection open now, dropping what it holds
//	hold MS PORT         every connection open now to listening port PORT
//	                     forwards nothing for MS, then what it holds (a
//	                     path stuck while new connections take another)
//	ok                   back to a plain pipe (a hold runs its course)
//
// A TCP stream cannot lose bytes and stay a stream, so a lossy link is
// modelled as it shows itself to a TCP user: stalls (delay) and
// connections cut mid-stream (reset).
type linkProxy struct {
	delay, jitter atomic.Int64  // nanoseconds
	resetPPM      atomic.Uint32 // parts per million

	mu    sync.Mutex
	conns map[net.Conn]*proxied // the client's end of each pair -> the rest
}

// proxied is a forwarded connection: the server's end, the proxy's port
// the client reached, and until when it is held (unix nanoseconds).
type proxied struct {
	up   net.Conn
	port string
	hold atomic.Int64
}

// RunProxy serves pairs of "listen=target" addresses until stdin closes,
// obeying the commands read from it.
func RunProxy(pairs []string, stdin io.Reader, stdout io.Writer) error {
	p := &linkProxy{conns: map[net.Conn]*proxied{}}
	for _, pair := range pairs {
		listen, target, ok := strings.Cut(pair, "=")
		if !ok {
			return fmt.Errorf("proxy: %q is not listen=target", pair)
		}
		ln, err := net.Listen("tcp", listen)
		if err != nil {
			return err
		}
		defer ln.Close()
		go p.serve(ln, target)
	}
	fmt.Fprintln(stdout, "ready")
	sc := bufio.NewScanner(stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		switch {
		case f[0] == "delay" && len(f) == 3:
			d, _ := strconv.Atoi(f[1])
			j, _ := strconv.Atoi(f[2])
			p.delay.Store(int64(d) * int64(time.Millisecond))
			p.jitter.Store(int64(j) * int64(time.Millisecond))
		case f[0] == "reset" && len(f) == 2:
			pr, _ := strconv.ParseFloat(f[1], 64)
			p.resetPPM.Store(uint32(pr * 1e6))
		case f[0] == "cut" && len(f) == 1:
			p.cut()
		case f[0] == "hold" && len(f) == 3:
			ms, _ := strconv.Atoi(f[1])
			p.holdAll(time.Duration(ms)*time.Millisecond, f[2])
		case f[0] == "ok":
			p.delay.Store(0)
			p.jitter.Store(0)
			p.resetPPM.Store(0)
		default:
			fmt.Fprintf(stdout, "error: unknown command %q\n", sc.Text())
			continue
		}
		fmt.Fprintln(stdout, "ok")
	}
	return sc.Err()
}

func (p *linkProxy) serve(ln net.Listener, target string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go p.pipe(c, target)
	}
}

func (p *linkProxy) track(down net.Conn, c *proxied) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c != nil {
		p.conns[down] = c
	} else {
		delete(p.conns, down)
	}
}

// cut closes both ends of every connection: a chunk read and not yet
// forwarded (held by a delay) is dropped, as a peer that crashed or a
// link that failed would drop it. Connections made after it are not
// touched.
func (p *linkProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for down, c := range p.conns {
		down.Close()
		c.up.Close()
	}
}

// holdAll holds every connection open now to port for d: each direction
// forwards its next chunk only once d is over. The peers' kernels keep
// taking what is sent meanwhile (the proxy's buffers are theirs), so a
// client that gives up and closes its end sees nothing wrong, and the
// server gets everything, in order, when the hold ends.
func (p *linkProxy) holdAll(d time.Duration, port string) {
	until := time.Now().Add(d).UnixNano()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		if c.port == port {
			c.hold.Store(until)
		}
	}
}

func (p *linkProxy) pipe(down net.Conn, target string) {
	defer down.Close()
	up, err := net.DialTimeout("tcp", target, 5*time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	c := &proxied{up: up}
	if a, ok := down.LocalAddr().(*net.TCPAddr); ok {
		c.port = strconv.Itoa(a.Port)
	}
	p.track(down, c)
	defer p.track(down, nil)
	done := make(chan struct{}, 2)
	go func() { p.copy(up, down, &c.hold); done <- struct{}{} }()
	go func() { p.copy(down, up, &c.hold); done <- struct{}{} }()
	<-done
	<-done
}

// copy forwards src to dst chunk by chunk, applying the current faults,
// until src ends; then it half-closes dst, as TCP passes a FIN on: what a
// peer sent and the proxy took is delivered, even when that peer has gone
// since (a client that gave up on a held connection). A reset ("reset")
// closes both ends at once instead. If dst fails, src is still read to
// its end and dropped, so that its sender is not reset before it read
// what it was sent. (Before, the first side to end closed both, and a
// server could be reset before it had read what the proxy delivered.)
func (p *linkProxy) copy(dst, src net.Conn, hold *atomic.Int64) {
	buf := make([]byte, 64<<10)
	broken := false
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if until := hold.Load(); until > 0 {
				time.Sleep(time.Until(time.Unix(0, until)))
			}
			if d := p.delay.Load(); d > 0 {
				if j := p.jitter.Load(); j > 0 {
					d += rand.Int64N(j)
				}
				time.Sleep(time.Duration(d))
			}
			if ppm := p.resetPPM.Load(); ppm > 0 && rand.Uint32N(1e6) < ppm {
				dst.Close()
				src.Close()
				return
			}
			if !broken {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					broken = true
				}
			}
		}
		if err != nil {
			if tc, ok := dst.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			} else {
				dst.Close()
			}
			return
		}
	}
}
