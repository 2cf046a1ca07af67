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
//	ok                   back to a plain pipe
//
// A TCP stream cannot lose bytes and stay a stream, so a lossy link is
// modelled as it shows itself to a TCP user: stalls (delay) and
// connections cut mid-stream (reset).
type linkProxy struct {
	delay, jitter atomic.Int64  // nanoseconds
	resetPPM      atomic.Uint32 // parts per million

	mu    sync.Mutex
	conns map[net.Conn]net.Conn // the client's end of each pair -> the server's
}

// RunProxy serves pairs of "listen=target" addresses until stdin closes,
// obeying the commands read from it.
func RunProxy(pairs []string, stdin io.Reader, stdout io.Writer) error {
	p := &linkProxy{conns: map[net.Conn]net.Conn{}}
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

func (p *linkProxy) track(down, up net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if up != nil {
		p.conns[down] = up
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
	for down, up := range p.conns {
		down.Close()
		up.Close()
	}
}

func (p *linkProxy) pipe(down net.Conn, target string) {
	defer down.Close()
	up, err := net.DialTimeout("tcp", target, 5*time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	p.track(down, up)
	defer p.track(down, nil)
	done := make(chan struct{}, 2)
	go func() { p.copy(up, down); done <- struct{}{} }()
	go func() { p.copy(down, up); done <- struct{}{} }()
	<-done
}

// copy forwards src to dst chunk by chunk, applying the current faults.
// When either side ends it closes both (the other copy then ends too).
func (p *linkProxy) copy(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if d := p.delay.Load(); d > 0 {
				if j := p.jitter.Load(); j > 0 {
					d += rand.Int64N(j)
				}
				time.Sleep(time.Duration(d))
			}
			if ppm := p.resetPPM.Load(); ppm > 0 && rand.Uint32N(1e6) < ppm {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
