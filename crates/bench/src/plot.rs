//! Plots as SVG and PNG, drawn with plotters.
//!
//! Text in the PNG is rasterised from a font bundled in this crate (`fonts/`, an ASCII, Latin-1
//! and a few symbols subset of DejaVu Sans, about 40 KB), so plots render the same on any machine
//! with no system fonts, fontconfig or freetype. The SVG names the `sans-serif` family and leaves
//! the rendering to the viewer.

use crate::Error;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::fmt::Display;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Once;

/// Width and height of every plot, in pixels (SVG and PNG alike).
pub const PLOT_SIZE_PX: (u32, u32) = (1024, 640);

/// Series with at most this many points also get a marker per point.
const MARKED_POINTS_MAX: usize = 40;

const FONT_TTF: &[u8] = include_bytes!("../fonts/DejaVuSans-subset.ttf");

/// Tableau 10: distinct to most colour-blind readers, in the order series are given.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// One named line of `(x, y)` points; points with a non-finite coordinate are not drawn.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One named set of bars of a [`bar_plot`]: `values[i]` is the bar in group `i`.
#[derive(Clone, Debug)]
pub struct BarSeries {
    pub name: String,
    pub values: Vec<f64>,
}

/// Scale of the x axis. On [`Scale::Log`], points with x ≤ 0 are not drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    Linear,
    Log,
}

/// Draws `series` as lines into `<path_stem>.svg` and `<path_stem>.png`; returns both paths.
/// The y axis starts at zero (or lower, for negative values), so drops are seen at true size.
pub fn line_plot(
    path_stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    x_scale: Scale,
) -> Result<[PathBuf; 2], Error> {
    let figure = XyFigure {
        title,
        x_label,
        y_label,
        series,
        x_scale,
        cdf: false,
    };
    render(path_stem, &figure)
}

/// Draws latency CDFs (points from [`crate::LatencyRecorder::cdf_points`]): x is the latency,
/// y the fraction of operations at or below it, from 0 to 1. Writes `<path_stem>.svg` and `.png`.
pub fn cdf_plot(
    path_stem: &Path,
    title: &str,
    x_label: &str,
    series: &[Series],
    x_scale: Scale,
) -> Result<[PathBuf; 2], Error> {
    let y_label = "fraction of operations ≤ x";
    let figure = XyFigure {
        title,
        x_label,
        y_label,
        series,
        x_scale,
        cdf: true,
    };
    render(path_stem, &figure)
}

/// Draws grouped bars: one group per entry of `groups` (e.g. a failure scenario), one bar per
/// [`BarSeries`] in each group (e.g. a failover policy). Writes `<path_stem>.svg` and `.png`.
/// Panics if a series does not have one value per group.
pub fn bar_plot(
    path_stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    groups: &[&str],
    bars: &[BarSeries],
) -> Result<[PathBuf; 2], Error> {
    for bar in bars {
        assert_eq!(
            bar.values.len(),
            groups.len(),
            "bar series {:?} needs one value per group",
            bar.name
        );
    }
    render(
        path_stem,
        &BarFigure {
            title,
            x_label,
            y_label,
            groups,
            bars,
        },
    )
}

/// Something drawable on any plotters backend: one drawing serves both the SVG and the PNG.
trait Figure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB>;
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn render(path_stem: &Path, figure: &impl Figure) -> Result<[PathBuf; 2], Error> {
    static FONTS: Once = Once::new();
    FONTS.call_once(|| {
        for family in ["sans-serif", "serif", "monospace"] {
            let registered = register_font(family, FontStyle::Normal, FONT_TTF);
            assert!(registered.is_ok(), "the bundled font parses");
        }
    });
    let [svg, png] = ["svg", "png"].map(|extension| {
        let mut path = path_stem.as_os_str().to_owned();
        path.push(".");
        path.push(extension);
        PathBuf::from(path)
    });
    let plot_error = |path: &Path, error: &dyn Display| Error::Plot {
        path: path.to_path_buf(),
        message: error.to_string(),
    };
    draw_on(
        SVGBackend::new(&svg, PLOT_SIZE_PX).into_drawing_area(),
        figure,
    )
    .map_err(|e| plot_error(&svg, &e))?;
    draw_on(
        BitMapBackend::new(&png, PLOT_SIZE_PX).into_drawing_area(),
        figure,
    )
    .map_err(|e| plot_error(&png, &e))?;
    Ok([svg, png])
}

fn draw_on<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    figure: &impl Figure,
) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    figure.draw(&root)?;
    root.present()
}

struct XyFigure<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    series: &'a [Series],
    x_scale: Scale,
    cdf: bool,
}

impl XyFigure<'_> {
    fn drawn(&self, &(x, y): &(f64, f64)) -> bool {
        x.is_finite() && y.is_finite() && (self.x_scale == Scale::Linear || x > 0.0)
    }

    fn drawn_points(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.series
            .iter()
            .flat_map(|s| &s.points)
            .filter(|p| self.drawn(p))
            .copied()
    }

    fn draw_with_x<DB, X>(
        &self,
        root: &DrawingArea<DB, Shift>,
        x_spec: X,
        y_range: Range<f64>,
    ) -> DrawResult<DB>
    where
        DB: DrawingBackend,
        X: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64>,
    {
        let mut chart = chart_builder(root, self.title).build_cartesian_2d(x_spec, y_range)?;
        let x_tick_label = match self.x_scale {
            Scale::Linear => tick_label,
            Scale::Log => log_tick_label,
        };
        chart
            .configure_mesh()
            .x_desc(self.x_label)
            .y_desc(self.y_label)
            .x_label_formatter(&x_tick_label)
            .y_label_formatter(&tick_label)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()?;
        for (i, series) in self.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let points = || series.points.iter().filter(|p| self.drawn(p)).copied();
            chart
                .draw_series(LineSeries::new(points(), color.stroke_width(2)))?
                .label(&series.name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                });
            if series.points.len() <= MARKED_POINTS_MAX {
                chart.draw_series(points().map(|p| Circle::new(p, 3, color.filled())))?;
            }
        }
        // A CDF rises from the lower left, leaving the lower right free for the legend.
        let legend_at = if self.cdf {
            SeriesLabelPosition::LowerRight
        } else {
            SeriesLabelPosition::UpperRight
        };
        draw_legend(&mut chart, legend_at)
    }
}

impl Figure for XyFigure<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let (x_min, x_max) = span(self.drawn_points().map(|(x, _)| x));
        let y_range = if self.cdf {
            0.0..1.0
        } else {
            let (y_min, y_max) = span(self.drawn_points().map(|(_, y)| y).chain([0.0]));
            // Headroom above the highest point for the legend.
            y_min..y_max + 0.2 * (y_max - y_min)
        };
        match self.x_scale {
            Scale::Linear => self.draw_with_x(root, x_min..x_max, y_range),
            Scale::Log if x_min < x_max => {
                self.draw_with_x(root, (x_min..x_max).log_scale(), y_range)
            }
            // A single x value (or none): a decade around it.
            Scale::Log => {
                let x = if x_min > 0.0 { x_min } else { 1.0 };
                self.draw_with_x(root, (x / 10.0..x * 10.0).log_scale(), y_range)
            }
        }
    }
}

struct BarFigure<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    groups: &'a [&'a str],
    bars: &'a [BarSeries],
}

impl Figure for BarFigure<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let values = self
            .bars
            .iter()
            .flat_map(|b| &b.values)
            .copied()
            .filter(|v| v.is_finite());
        let (y_min, y_max) = span(values.chain([0.0]));
        // Group i is centred on x = i; ticks fall on whole numbers, which are labelled by group.
        let x_range = -0.5..self.groups.len().max(1) as f64 - 0.5;
        let mut chart = chart_builder(root, self.title)
            .build_cartesian_2d(x_range, y_min..y_max + 0.2 * (y_max - y_min))?;
        let group_label = |x: &f64| {
            let i = x.round();
            let is_centre = (x - i).abs() < 1e-6 && i >= 0.0;
            let name = is_centre.then(|| self.groups.get(i as usize)).flatten();
            name.map_or_else(String::new, |name| name.to_string())
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(self.groups.len())
            .x_label_formatter(&group_label)
            .y_label_formatter(&tick_label)
            .x_desc(self.x_label)
            .y_desc(self.y_label)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()?;
        let bar_width = 0.8 / self.bars.len().max(1) as f64;
        for (j, bar) in self.bars.iter().enumerate() {
            let color = PALETTE[j % PALETTE.len()];
            let rectangles = bar
                .values
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| {
                    let left = i as f64 - 0.4 + j as f64 * bar_width;
                    Rectangle::new([(left, 0.0), (left + 0.9 * bar_width, v)], color.filled())
                });
            chart
                .draw_series(rectangles)?
                .label(&bar.name)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                });
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)
    }
}

fn chart_builder<'a, 'b, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, DB> {
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(56)
        .y_label_area_size(80);
    builder
}

fn draw_legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> DrawResult<DB>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
}

/// The (min, max) of `values`, widened so that min < max; (0, 1) when there are none.
fn span(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (min, max) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    match (min, max) {
        (min, max) if min < max => (min, max),
        (min, _) if min.is_finite() => (
            min - min.abs().max(1.0) * 0.5,
            min + min.abs().max(1.0) * 0.5,
        ),
        _ => (0.0, 1.0),
    }
}

/// Short tick labels: `0.25`, `150`, `12k`, `3.5M`.
fn tick_label(value: &f64) -> String {
    let (scaled, suffix) = match value.abs() {
        v if v >= 1e6 => (value / 1e6, "M"),
        v if v >= 1e4 => (value / 1e3, "k"),
        _ => (*value, ""),
    };
    let digits = format!("{scaled:.3}");
    let trimmed = digits.trim_end_matches('0').trim_end_matches('.');
    let number = if trimmed == "-0" { "0" } else { trimmed };
    format!("{number}{suffix}")
}

/// Labels only the 1-2-5 ticks of a log axis (plotters places ticks at every digit, whose
/// labels run into each other near the end of each decade).
fn log_tick_label(value: &f64) -> String {
    let mantissa = value / 10f64.powf(value.log10().floor());
    let labelled = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .any(|m| (mantissa - m).abs() < 1e-6);
    if labelled {
        tick_label(value)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::test_dir;
    use crate::LatencyRecorder;

    /// Dark pixels in a band of the PNG: text and lines drawn there, not just a white page.
    fn dark_pixels(png: &Path, rows: Range<u32>) -> usize {
        let image = image::open(png).unwrap().to_rgb8();
        assert_eq!(image.dimensions(), PLOT_SIZE_PX);
        let dark = |p: &image::Rgb<u8>| p.0.iter().map(|&c| c as u32).sum::<u32>() < 3 * 100;
        rows.flat_map(|y| (0..image.width()).map(move |x| (x, y)))
            .filter(|&(x, y)| dark(image.get_pixel(x, y)))
            .count()
    }

    #[test]
    fn line_plot_writes_svg_and_png_with_text() {
        let stem = test_dir("plots").join("timeline");
        let series = [
            Series {
                name: "speculative".into(),
                points: (0..50).map(|i| (i as f64 * 0.1, 1000.0)).collect(),
            },
            Series {
                name: "reds".into(),
                points: (0..50)
                    .map(|i| (i as f64 * 0.1, if i < 20 { 1000.0 } else { 0.0 }))
                    .collect(),
            },
        ];
        let [svg, png] = line_plot(
            &stem,
            "Throughput during failover",
            "time (s)",
            "ops/s",
            &series,
            Scale::Linear,
        )
        .unwrap();
        let svg_text = std::fs::read_to_string(&svg).unwrap();
        for text in [
            "Throughput during failover",
            "time (s)",
            "speculative",
            "reds",
        ] {
            assert!(
                svg_text.contains(text),
                "{text} missing from {}",
                svg.display()
            );
        }
        // The title is rasterised in the top band of the PNG.
        assert!(
            dark_pixels(&png, 0..40) > 200,
            "no title text in {}",
            png.display()
        );
    }

    #[test]
    fn cdf_plot_on_log_axis_from_recorders() {
        let stem = test_dir("plots").join("latency_cdf");
        let series: Vec<Series> = [("plain", 100u64), ("super", 130)]
            .into_iter()
            .map(|(name, base_us)| {
                let mut recorder = LatencyRecorder::new();
                for i in 0..10_000u64 {
                    recorder.record_us(base_us + (i * i) % 5000);
                }
                Series {
                    name: name.into(),
                    points: recorder.cdf_points(),
                }
            })
            .collect();
        let [_, png] = cdf_plot(
            &stem,
            "4 KiB write latency",
            "latency (µs)",
            &series,
            Scale::Log,
        )
        .unwrap();
        assert!(dark_pixels(&png, 0..40) > 200);
    }

    #[test]
    fn bar_plot_groups_bars_and_labels_groups() {
        let stem = test_dir("plots").join("failover");
        let bars = [
            BarSeries {
                name: "reds".into(),
                values: vec![9.5, 12.0, 30.0],
            },
            BarSeries {
                name: "speculative".into(),
                values: vec![2.0, 3.1, 4.2],
            },
            BarSeries {
                name: "oracle".into(),
                values: vec![1.0, 1.0, 1.0],
            },
        ];
        let groups = ["crash", "hang", "partition"];
        let [svg, png] = bar_plot(
            &stem,
            "Failover latency",
            "scenario",
            "failover latency (s)",
            &groups,
            &bars,
        )
        .unwrap();
        let svg_text = std::fs::read_to_string(&svg).unwrap();
        for text in groups.iter().chain(&["reds", "speculative", "oracle"]) {
            assert!(
                svg_text.contains(text),
                "{text} missing from {}",
                svg.display()
            );
        }
        assert!(dark_pixels(&png, 0..40) > 200);
    }

    #[test]
    fn plot_into_missing_directory_is_an_error() {
        let stem = Path::new("/nonexistent-understudy-dir/plot");
        let result = line_plot(stem, "t", "x", "y", &[], Scale::Linear);
        assert!(matches!(result, Err(Error::Plot { .. })), "{result:?}");
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick_label(&0.25), "0.25");
        assert_eq!(tick_label(&150.0), "150");
        assert_eq!(tick_label(&12_000.0), "12k");
        assert_eq!(tick_label(&3_500_000.0), "3.5M");
        assert_eq!(tick_label(&-0.0001), "0");
        assert_eq!(log_tick_label(&200.0), "200");
        assert_eq!(log_tick_label(&0.05), "0.05");
        assert_eq!(log_tick_label(&900.0), "");
    }

    #[test]
    fn span_is_never_empty() {
        assert_eq!(span([2.0, 5.0].into_iter()), (2.0, 5.0));
        assert_eq!(span([4.0].into_iter()), (2.0, 6.0));
        assert_eq!(span(std::iter::empty()), (0.0, 1.0));
    }
}
